"""aiayn's decoder equals Hugging Face ``Gemma2ForCausalLM`` and ``GemmaForCausalLM`` built from
configs (random weights, no download). Gemma 2: sandwich norms, every other layer sliding (window 8),
attention scores and logits soft-capped (c * tanh(x / c)), embeddings times sqrt(D), Gemma's 1 + w
RMSNorm, and the 27B's scores times query_pre_attn_scalar^-1/2 with it not the head width. Gemma:
Llama's two norms a layer, GEGLU, multi-query attention, embeddings times sqrt(D). Logits within
1e-4 at 40 positions with right and left padding; each soft-cap and the 27B's scale matter; 50
greedy tokens of left-padded prompts equal HF ``generate``; round trips that transformers loads as
the same class, with the same query_pre_attn_scalar; transformers 4's config layout; the
soft-capped kernel refuses what it cannot do."""

from __future__ import annotations

import json

import pytest
import torch

import aiayn
from aiayn.interop.hf import from_transformers
from hf_helpers import greedy_tokens_and_hf_generate, padded_logits, randomise

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW_TOKENS = 97, 50
needs_gemma2 = pytest.mark.skipif(not hasattr(transformers, "Gemma2ForCausalLM"),
                                  reason=f"transformers {transformers.__version__} has no Gemma 2")


def hf_gemma2(std: float = 0.15, **fields):
    """A Gemma 2 whose soft-caps bite: scores and logits grow past the caps at this scale."""
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=16, max_position_embeddings=128, sliding_window=8,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                    pad_token_id=0, bos_token_id=2, eos_token_id=1)
    config = transformers.Gemma2Config(**{**settings, **fields})
    config._attn_implementation = "eager"  # transformers' soft-capping path
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    randomise(model, std=std, skip=("rotary_emb", "embed_scale"))
    return model


def hf_gemma2_27b(std: float = 0.15):
    """Gemma 2 27B's scale at this size: query_pre_attn_scalar (24) is not the head width (16)."""
    return hf_gemma2(std, query_pre_attn_scalar=24)


def hf_gemma(std: float = 0.15, **fields):
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    max_position_embeddings=128, hidden_act="gelu_pytorch_tanh",
                    pad_token_id=0, bos_token_id=2, eos_token_id=1)
    config = transformers.GemmaConfig(**{**settings, **fields})
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(config).eval()
    randomise(model, std=std, skip=("rotary_emb", "embed_scale"))
    return model


BUILDERS = {"gemma2": hf_gemma2, "gemma2-27b": hf_gemma2_27b, "gemma": hf_gemma}


@needs_gemma2
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_gemma2_logits_match_hf_past_the_window_with_right_and_left_padding(fused):
    hf = hf_gemma2()
    ours = from_transformers(hf, fused_projections=fused)
    config = ours.config
    assert (config.sliding_window, config.sliding_window_layers) == (8, [0, 2])
    assert (config.attention_softcap, config.logit_softcap) == (2.0, 3.0)
    assert config.attention == "reference" and config.sandwich_norm and not config.qk_norm
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):  # right, then left
        assert want[mask].std() > 0.5 and want[mask].abs().max() < 3.0  # capped at 3
        assert (got - want)[mask].abs().max() < 1e-4
    # each Gemma 2 piece matters at these lengths and scales: without it the logits differ
    for change in (dict(attention_softcap=None), dict(logit_softcap=None),
                   dict(sliding_window_layers=[0])):
        other = from_transformers(hf, fused_projections=fused, **change)
        got, want, mask = padded_logits(hf, other, VOCAB, [40, 31, 23])[0]
        assert (got - want)[mask].abs().max() > 1e-2, change


@needs_gemma2
@pytest.mark.parametrize("softcap", [2.0, None], ids=["reference", "fused"])
def test_a_query_pre_attn_scalar_other_than_the_head_width_scales_the_scores(softcap):
    """Gemma 2 27B's layout (query_pre_attn_scalar 144 = D / H, head width 128) at head width 16
    and query_pre_attn_scalar 24: scores times 24^-1/2, through the soft-capped reference kernel
    and through SDPA; the head width's scale instead changes the logits."""
    hf = hf_gemma2(query_pre_attn_scalar=24, attn_logit_softcapping=softcap)
    ours = from_transformers(hf)
    assert ours.config.attention_scale == 24 ** -0.5 and ours.config.head_dim == 16
    assert ours.config.attention == ("reference" if softcap else "fused")
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):  # right, then left
        assert want[mask].std() > 0.5
        assert (got - want)[mask].abs().max() < 1e-4
    head_width = from_transformers(hf, attention_scale=None)
    got, want, mask = padded_logits(hf, head_width, VOCAB, [40, 31, 23])[0]
    assert (got - want)[mask].abs().max() > 1e-2


def test_gemma_2_27b_config_json_reads_its_scale_and_writes_it_back(tmp_path):
    """The 27B's published attention sizes: query_pre_attn_scalar 144 (4608 / 32) with head_dim
    128 becomes attention_scale 144^-1/2, and export writes 144 back, an int; the head width's
    scalar is no field at all; a scalar that is no positive number is refused."""
    gemma2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=VOCAB,
                  hidden_size=4608, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                  query_pre_attn_scalar=144, sliding_window=4096, rope_theta=10000.0,
                  final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, gemma2, {}, {})
    read = aiayn.interop.hf_gemma.config_from_hf
    ours = read(gemma2, checkpoint, {})
    assert ours.attention_scale == 144 ** -0.5 and ours.head_dim == 128
    scalar = aiayn.interop.hf_gemma._query_pre_attn_scalar(ours)
    assert scalar == 144 and type(scalar) is int
    assert read({**gemma2, "query_pre_attn_scalar": 128}, checkpoint, {}).attention_scale is None
    assert aiayn.interop.hf_gemma._query_pre_attn_scalar(ours.replace(attention_scale=0.3)) \
        == pytest.approx(0.3 ** -2)
    for bad in (0, -144, "144", True):
        with pytest.raises(ValueError, match="query_pre_attn_scalar must be a positive number"):
            read({**gemma2, "query_pre_attn_scalar": bad}, checkpoint, {})
    gemma = dict(gemma2, model_type="gemma", architectures=["GemmaForCausalLM"])
    assert read(gemma, checkpoint, {}).attention_scale is None  # Gemma scales by Dh^-1/2 alone


def test_gemma_logits_match_hf_with_right_and_left_padding():
    hf = hf_gemma()
    ours = from_transformers(hf)
    config = ours.config
    assert config.kv_heads == 1 and config.scale_embeddings and not config.sandwich_norm
    assert config.activation == "gelu_tanh" and config.sliding_window is None
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):
        assert want[mask].std() > 0.1
        assert (got - want)[mask].abs().max() < 1e-4


@pytest.mark.parametrize("family", [pytest.param("gemma2", marks=needs_gemma2),
                                    pytest.param("gemma2-27b", marks=needs_gemma2), "gemma"])
def test_fifty_greedy_tokens_of_left_padded_prompts_equal_hf_generate(family):
    hf = BUILDERS[family](std=0.3)
    ours = from_transformers(hf)
    got, want = greedy_tokens_and_hf_generate(hf, ours, VOCAB, new_tokens=NEW_TOKENS)
    assert got == want
    assert len({tuple(row) for row in want}) == 3


@pytest.mark.parametrize("family, cls", [
    pytest.param("gemma2", "Gemma2ForCausalLM", marks=needs_gemma2),
    pytest.param("gemma2-27b", "Gemma2ForCausalLM", marks=needs_gemma2),
    ("gemma", "GemmaForCausalLM")])
def test_save_pretrained_round_trips_through_transformers(tmp_path, family, cls):
    hf = BUILDERS[family]()
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager").eval()
    assert type(again).__name__ == cls
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written.get("query_pre_attn_scalar") == getattr(hf.config, "query_pre_attn_scalar",
                                                           None)
    assert aiayn.from_pretrained(tmp_path / "ours").config == ours.config
    ids = torch.randint(3, VOCAB, (2, 30))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-4)


def test_a_transformers_4_config_json_reads_the_same(tmp_path):
    """Gemma 2's config.json as transformers 4 wrote it (rope_theta, no layer_types: the even
    layers slide) and Gemma's (hidden_act "gelu", which transformers reads as the tanh GELU)."""
    gemma2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=VOCAB,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  query_pre_attn_scalar=16, sliding_window=4096, rope_theta=10000.0,
                  hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                  final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, gemma2, {}, {})
    ours = aiayn.interop.hf_gemma.config_from_hf(gemma2, checkpoint, {})
    assert ours.sliding_window_layers == [0, 2, 4] and ours.sliding_window == 4096
    assert (ours.rope_theta, ours.rope_local_theta, ours.rope_scaling) == (1e4, None, None)
    assert (ours.attention_softcap, ours.logit_softcap, ours.attention) == (50.0, 30.0,
                                                                          "reference")
    gemma = dict(model_type="gemma", architectures=["GemmaForCausalLM"], vocab_size=VOCAB,
                 hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, hidden_act="gelu", rope_theta=10000.0)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, gemma, {}, {})
    ours = aiayn.interop.hf_gemma.config_from_hf(gemma, checkpoint, {})
    assert ours.activation == "gelu_tanh" and ours.sliding_window is None
    assert (ours.attention_softcap, ours.logit_softcap) == (None, None)


@pytest.mark.parametrize("family", [pytest.param("gemma2", marks=needs_gemma2), "gemma"])
def test_a_config_json_without_head_dim_or_query_pre_attn_scalar_takes_transformers_defaults(
        tmp_path, family):
    """A config.json that leaves out head_dim (and Gemma 2's query_pre_attn_scalar) is read as
    transformers reads it, 256 for both, not D / H: the directory loads to transformers' logits
    when both models read the same stripped file."""
    shape = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=256)
    hf = hf_gemma2(query_pre_attn_scalar=256, **shape) if family == "gemma2" else \
        hf_gemma(**shape)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for field in ("head_dim", "query_pre_attn_scalar"):
        config.pop(field, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    assert again.config.head_dim == 256
    ours = aiayn.from_pretrained(tmp_path)
    assert ours.config.head_dim == 256 and ours.config.attention_scale is None
    ids = torch.randint(3, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), again(ids).logits, rtol=0, atol=1e-4)


def test_soft_capping_scores_needs_the_reference_kernel(tmp_path):
    with pytest.raises(ValueError, match="attention_softcap transforms every attention score, "
                                         "which only attention='reference' writes out"):
        aiayn.TransformerConfig.preset("llama-char", attention_softcap=50.0)
    with pytest.raises(ValueError, match="logit_softcap must be a positive number"):
        aiayn.TransformerConfig.preset("llama-char", logit_softcap=0)
    config = aiayn.TransformerConfig.preset("llama-char", attention="reference",
                                            attention_softcap=50.0)
    with pytest.raises(ValueError, match="soft-capped reference kernel"):
        aiayn.nn.attention.kernels.swap_exact_kernels(aiayn.CausalLM(config), "fused")


def test_soft_capped_scores_and_logits_by_hand():
    """One layer written out: softmax(c * tanh(q k^T / sqrt(Dh) / c)) v with the causal mask; the
    attention maps returned carry the cap too; logits c * tanh(x / c)."""
    from aiayn.nn.attention.kernels import ReferenceAttention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4) * 3 for _ in range(3))
    scores = q @ k.transpose(-2, -1) / 2  # sqrt(Dh) = 2
    capped = 1.5 * torch.tanh(scores / 1.5)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    weights = capped.masked_fill(~causal, float("-inf")).softmax(-1)
    out, got = ReferenceAttention(softcap=1.5).with_weights(q, k, v, causal=True)
    torch.testing.assert_close(got, weights)
    torch.testing.assert_close(out, weights @ v)
    config = aiayn.TransformerConfig.preset("llama-char", logit_softcap=2.0, vocab_size=11,
                                            max_length=8)
    model = aiayn.CausalLM(config).eval()
    ids = torch.randint(11, (2, 6))
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        plain = torch.nn.functional.linear(hidden, model.lm_head.weight)
        torch.testing.assert_close(model(ids), 2.0 * torch.tanh(plain / 2.0))
        _, maps = model(ids, return_attention=True)
    assert maps.decoder[0].shape[-1] == 6


def test_training_loss_of_a_soft_capped_model_is_the_capped_logits_cross_entropy():
    """On the CPU the loss of an uncapped model takes the chunked path; a capped one the logits'."""
    from aiayn.tasks.lm import token_loss

    config = aiayn.TransformerConfig.preset("llama-char", logit_softcap=0.5, vocab_size=13,
                                            max_length=8)
    torch.manual_seed(0)
    model = aiayn.CausalLM(config)
    ids = torch.randint(13, (3, 8))
    loss = token_loss(model, ids[:, :-1], ids[:, 1:])
    want = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                             ids[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(loss, want)
    loss.backward()
    assert model.lm_head.weight.grad is not None
