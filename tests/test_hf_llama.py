"""aiayn's modern decoder equals Hugging Face ``LlamaForCausalLM`` built from configs (random weights,
no download): logits within 1e-4 in float32 with right and left padding, grouped-query (8 query / 2
key-value heads), multi-query and multi-head attention, tied and untied embeddings, a head width of
its own, scaled RoPE (linear, Llama 3.1's, YaRN) past the original context; save_pretrained /
from_pretrained round trips that transformers loads; 50 greedy tokens identical to HF ``generate``,
also for a batch of left-padded prompts."""

from __future__ import annotations

import inspect

import pytest
import torch

import aiayn
from aiayn.decoding.generation import generate
from aiayn.interop.hf import from_transformers
from hf_helpers import left_padded, padded_logits, randomise

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW_TOKENS = 97, 50
CASES = {
    "gqa-8q-2kv-untied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "gqa-tied": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True),
    "mqa-theta500": dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500.0),
    "mha-head-dim-12": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=12),
}
# Scaled RoPE, the original context shorter than the test's sequences so that scaling matters
SCALED = {
    "rope-linear": {"rope_type": "linear", "factor": 4.0},
    "rope-llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "rope-yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                  "beta_fast": 16.0, "mscale": 0.9, "mscale_all_dim": 1.0},
}
try:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except ImportError:  # transformers < 4.42
    ROPE_INIT_FUNCTIONS = {}
for _name, _scaling in SCALED.items():  # transformers 5's rope_parameters, 4's rope_scaling
    CASES[_name] = dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                        **({"rope_parameters": {**_scaling, "rope_theta": 10000.0}}
                           if "rope_parameters" in inspect.signature(
                               transformers.LlamaConfig.__init__).parameters
                           else {"rope_scaling": _scaling}))
# A head width other than d_model / heads: LlamaConfig's head_dim, which older transformers ignore.
HEAD_DIM = pytest.mark.skipif(
    "head_dim" not in inspect.signature(transformers.LlamaConfig.__init__).parameters,
    reason=f"transformers {transformers.__version__}: LlamaConfig has no head_dim")


def cases(*names: str) -> list:
    def marks(name: str):
        if "head-dim" in name:
            return HEAD_DIM
        if name in SCALED and SCALED[name]["rope_type"] not in ROPE_INIT_FUNCTIONS:
            return pytest.mark.skip(reason=f"transformers {transformers.__version__} has no "
                                           f"{SCALED[name]['rope_type']} RoPE for Llama")
        return ()
    return [pytest.param(name, marks=marks(name)) for name in names]


def hf_llama(case: str, std: float = 0.15):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **CASES[case])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    randomise(model, std=std, skip=("rotary_emb",))  # inv_freq is a buffer, not a weight
    return model


@pytest.mark.parametrize("case", cases(*CASES))
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_logits_match_hf_with_right_and_left_padding(case, fused):
    hf = hf_llama(case)
    ours = from_transformers(hf, fused_projections=fused)
    if case == "gqa-tied":
        assert ours.lm_head.weight is ours.decoder.embeddings.tokens.weight
    for got, want, mask in padded_logits(hf, ours, VOCAB, [11, 7, 4]):  # right, then left
        assert want[mask].std() > 0.1  # far from uniform: the test can fail
        assert (got - want)[mask].abs().max() < 1e-4


@pytest.mark.parametrize("case", cases(*SCALED))
def test_scaled_rope_matches_hf_past_the_original_context(case):
    hf = hf_llama(case)
    ours = from_transformers(hf)
    assert ours.config.rope_scaling["rope_type"] == SCALED[case]["rope_type"]
    torch.testing.assert_close(ours.decoder.rotary.inverse_frequency, hf.model.rotary_emb.inv_freq,
                               rtol=0, atol=0)
    ids = torch.randint(3, VOCAB, (2, 100))  # positions up to 99, the original context is 16
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
        plain = from_transformers(hf, rope_scaling=None)(ids)
    assert (plain - want).abs().max() > 1e-2  # without the scaling the logits differ
    assert (got - want).abs().max() < 1e-4


@pytest.mark.parametrize("case", cases("gqa-8q-2kv-untied", "gqa-tied", "mha-head-dim-12",
                                       "rope-llama3", "rope-yarn"))
def test_save_pretrained_round_trips_through_transformers(tmp_path, case):
    hf = hf_llama(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again).__name__ == "LlamaForCausalLM"
    assert again.config.num_key_value_heads == hf.config.num_key_value_heads
    assert again.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert aiayn.from_pretrained(tmp_path / "ours").config == ours.config
    ids = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-4)
    hf_state, again_state = hf.state_dict(), again.state_dict()
    assert hf_state.keys() == again_state.keys()
    for name in hf_state:
        torch.testing.assert_close(again_state[name], hf_state[name], rtol=0, atol=0, msg=name)


def hf_greedy(hf, ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    hf.generation_config.eos_token_id = None  # 50 tokens, no early stop
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask.long(), do_sample=False, num_beams=1,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("case", cases("gqa-8q-2kv-untied", "gqa-tied", "rope-llama3"))
def test_fifty_greedy_tokens_equal_hf_generate(case):
    hf = hf_llama(case, std=0.3)
    ours = from_transformers(hf)
    for seed in range(3):
        prompt, mask = left_padded(VOCAB, [4 + seed], seed=seed)
        got = generate(ours, prompt, max_new_tokens=NEW_TOKENS, greedy=True).tokens
        assert got == hf_greedy(hf, prompt, mask)


def test_fifty_greedy_tokens_of_left_padded_prompts_equal_hf_generate():
    hf = hf_llama("gqa-8q-2kv-untied", std=0.3)
    ours = from_transformers(hf)
    ids, mask = left_padded(VOCAB, [9, 3, 6], seed=5)
    prompts = [row[row_mask].tolist() for row, row_mask in zip(ids, mask)]
    got = generate(ours, prompts, max_new_tokens=NEW_TOKENS, greedy=True).tokens
    want = hf_greedy(hf, ids, mask)
    assert got == want
    assert len({tuple(row) for row in want}) == 3  # the rows differ: padding is really exercised


@pytest.mark.parametrize("fields, message", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_type='dynamic' is not supported: its frequencies change"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}),
     "rope_type='longrope' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"missing \['low_freq_factor'"),
    (dict(attention_bias=True, mlp_bias=False), "attention_bias=True with mlp_bias=False"),
])
def test_unsupported_llama_configs_are_refused(tmp_path, fields, message):
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=4, **fields)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
    with pytest.raises(ValueError, match=message):
        aiayn.interop.hf_llama.config_from_hf(config, checkpoint, {})


def test_a_llama_3_2_config_json_reads_its_scaled_rope(tmp_path):
    """The rope fields of meta-llama/Llama-3.2-1B's config.json as published (transformers 4's
    layout: ``rope_theta`` beside ``rope_scaling``), shrunk to a tiny model."""
    scaling = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
                  rope_scaling=scaling, rope_theta=500000.0, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=[2, 3, 4])
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
    ours = aiayn.interop.hf_llama.config_from_hf(config, checkpoint, {})
    assert ours.rope_theta == 500000.0 and ours.rope_scaling == scaling
    assert (ours.max_length, ours.eos_id, ours.tie_output) == (131072, 2, True)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_a_partial_rotary_factor_is_refused_outside_phi3(tmp_path, where):
    """transformers' Llama-family configs may carry partial_rotary_factor; aiayn turns partial
    heads for Phi-3 alone, so elsewhere it is refused rather than read as whole-head RoPE."""
    config = dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    if where == "top":
        config["partial_rotary_factor"] = 0.5
    else:
        config["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0,
                                         partial_rotary_factor=0.5)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported for "
                                         "model_type 'qwen2'"):
        aiayn.interop.hf_llama.config_from_hf(config, checkpoint, {})
    config.pop("partial_rotary_factor", None)
    config.pop("rope_parameters", None)
    config["partial_rotary_factor"] = 1.0  # a whole head: read as before
    assert aiayn.interop.hf_llama.config_from_hf(config, checkpoint, {}).rotary_fraction == 1.0


def test_export_refuses_a_rotary_model_llama_cannot_express(tmp_path):
    model = aiayn.CausalLM(aiayn.TransformerConfig.preset("llama-char", norm="layer"))
    with pytest.raises(ValueError, match="Llama needs norm='rms'"):
        aiayn.save_pretrained(model, tmp_path)
    gpt = aiayn.CausalLM(aiayn.TransformerConfig.preset("char-gpt", norm="rms", bias=True))
    with pytest.raises(ValueError, match="cannot export as gpt2: it needs norm='layer'"):
        aiayn.save_pretrained(gpt, tmp_path)


@pytest.mark.parametrize("preset, changes, needs", [
    ("llama-char", dict(attention_scale=0.5), "Llama needs attention_scale=None"),
    ("char-gpt", dict(attention_scale=0.5, bias=True, layer_norm_bias=True),
     "gpt2: it needs attention_scale=None"),
    ("char-gpt", dict(bias=True), "gpt2: it needs layer_norm_bias=True"),
    ("encoder-small", dict(layer_norm_bias=False), "it needs layer_norm_bias=True")])
def test_export_refuses_a_score_scale_or_norm_without_bias_the_class_lacks(tmp_path, preset,
                                                                             changes, needs):
    """An explicit score scale or bias-free LayerNorms are refused, not silently dropped (the
    written checkpoint would give other logits) or failed on a missing weight."""
    config = aiayn.TransformerConfig.preset(preset, **changes)
    model = (aiayn.TransformerEncoder if config.n_decoder_layers == 0 else aiayn.CausalLM)(config)
    with pytest.raises(ValueError, match=needs):
        aiayn.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_pad_row_trains_as_in_transformers():
    """transformers' embedding has padding_idx = the config's pad_token_id: lookups of the pad
    (here also a real input, as a pad that is the end-of-text token is) add no gradient to its
    row, only the tied head's logits do; aiayn's imported model trains it the same way."""
    hf = hf_llama(next(iter(CASES)))
    ours = from_transformers(hf)
    assert ours.config.embedding_padding_idx and ours.config.pad_id == 0
    ids = torch.tensor([[5, 0, 7, 0, 9, 11]])  # the pad id 0 as a real token
    hf(input_ids=ids, labels=ids).loss.backward()
    logits = ours(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    torch.testing.assert_close(ours.decoder.embeddings.tokens.weight.grad,
                               hf.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-7)
