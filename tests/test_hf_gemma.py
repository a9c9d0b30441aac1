"""aiayn's decoder equals Hugging Face ``Gemma3ForCausalLM`` built from configs (random weights, no
download): sandwich norms, QK-norm, embeddings times sqrt(D), GEGLU, Gemma's 1 + w RMSNorm read as
a gain, two of three layers sliding (window 8) with RoPE base 10,000 and the global layer at 1e6
with linear scaling. Logits within 1e-4 at 40 positions with right and left padding, fused and
separate projections; 50 greedy tokens of left-padded prompts equal HF ``generate``; round trips
through ``save_pretrained`` that transformers loads as Gemma 3; a query_pre_attn_scalar other than
the head width; transformers 4's config layout; what aiayn cannot express is refused."""

from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.interop.hf import from_transformers
from hf_helpers import greedy_tokens_and_hf_generate, padded_logits, randomise

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.skipif(
    not hasattr(transformers, "Gemma3ForCausalLM"),
    reason=f"transformers {transformers.__version__} has no Gemma3ForCausalLM")]

VOCAB, NEW_TOKENS = 97, 50
ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def hf_gemma(std: float = 0.15, **fields):
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=16, max_position_embeddings=128, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters=ROPE, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    config = transformers.Gemma3TextConfig(**{**settings, **fields})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    randomise(model, std=std, skip=("rotary_emb", "embed_scale"))  # buffers, not weights
    return model


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_logits_match_hf_past_the_window_with_right_and_left_padding(fused):
    hf = hf_gemma()
    ours = from_transformers(hf, fused_projections=fused)
    config = ours.config
    assert (config.sliding_window, config.sliding_window_layers) == (8, [0, 1])
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    norm = ours.decoder.layers[0].feedforward_residual.post_norm.weight
    hf_norm = hf.model.layers[0].post_feedforward_layernorm.weight
    torch.testing.assert_close(norm, 1 + hf_norm, rtol=0, atol=0)  # Gemma's 1 + w, as a gain
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):  # right, then left
        assert want[mask].std() > 0.1
        assert (got - want)[mask].abs().max() < 1e-4
    # each Gemma-specific piece matters at these lengths: without it the logits differ
    for change in (dict(rope_local_theta=1e6), dict(sliding_window_layers=[0]),
                   dict(rope_scaling=None)):
        other = from_transformers(hf, fused_projections=fused, **change)
        got, want, mask = padded_logits(hf, other, VOCAB, [40, 31, 23])[0]
        assert (got - want)[mask].abs().max() > 1e-2, change


def test_a_query_pre_attn_scalar_other_than_the_head_width_loads_and_saves(tmp_path):
    """Scores times query_pre_attn_scalar^-1/2 (24, head width 16): logits within 1e-4 with right
    and left padding (the head width's scale changes them), written back as 24."""
    hf = hf_gemma(query_pre_attn_scalar=24)
    ours = from_transformers(hf)
    assert ours.config.attention_scale == 24 ** -0.5
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):
        assert (got - want)[mask].abs().max() < 1e-4
    got, want, mask = padded_logits(hf, from_transformers(hf, attention_scale=None), VOCAB,
                                    [40, 31, 23])[0]
    assert (got - want)[mask].abs().max() > 1e-2
    aiayn.save_pretrained(ours, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.query_pre_attn_scalar == 24
    assert aiayn.from_pretrained(tmp_path).config == ours.config


def test_fifty_greedy_tokens_of_left_padded_prompts_equal_hf_generate():
    hf = hf_gemma(std=0.3)
    ours = from_transformers(hf)
    got, want = greedy_tokens_and_hf_generate(hf, ours, VOCAB, new_tokens=NEW_TOKENS)
    assert got == want
    assert len({tuple(row) for row in want}) == 3


def test_save_pretrained_round_trips_through_transformers(tmp_path):
    hf = hf_gemma()
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again).__name__ == "Gemma3ForCausalLM"
    assert again.config.layer_types == hf.config.layer_types
    assert aiayn.from_pretrained(tmp_path / "ours").config == ours.config
    ids = torch.randint(3, VOCAB, (2, 30))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-4)
    hf_state, again_state = hf.state_dict(), again.state_dict()
    assert hf_state.keys() == again_state.keys()
    for name in hf_state:  # norms go through 1 + w and back: the float32 rounding of 1 + w
        torch.testing.assert_close(again_state[name], hf_state[name], rtol=0, atol=2.4e-7, msg=name)


def test_a_transformers_4_config_json_reads_the_same(tmp_path):
    """Gemma 3's config.json as transformers 4 wrote it: rope_theta, rope_local_base_freq,
    rope_scaling and sliding_window_pattern instead of nested rope_parameters and layer_types."""
    config = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=VOCAB,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  query_pre_attn_scalar=16, sliding_window=512, sliding_window_pattern=6,
                  rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 8.0},
                  hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768,
                  final_logit_softcapping=None, attn_logit_softcapping=None)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
    ours = aiayn.interop.hf_gemma.config_from_hf(config, checkpoint, {})
    assert ours.sliding_window_layers == [0, 1, 2, 3, 4, 6]  # every 6th layer (5) is global
    assert (ours.rope_theta, ours.rope_local_theta, ours.sliding_window) == (1e6, 1e4, 512)
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize("fields, message", [
    (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar must be a positive number, got 0"),
    (dict(layer_types=["sliding_attention"]), "layer_types must list 3"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
])
def test_what_aiayn_cannot_express_is_refused(tmp_path, fields, message):
    config = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=VOCAB,
                  hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, head_dim=16, **fields)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
    with pytest.raises(ValueError, match=message):
        aiayn.interop.hf_gemma.config_from_hf(config, checkpoint, {})


def test_export_names_what_gemma_3_cannot_express(tmp_path):
    base = aiayn.TransformerConfig.preset("llama-char", sandwich_norm=True, qk_norm=True)
    with pytest.raises(ValueError, match="Gemma 3: it needs activation='gelu_tanh'"):
        aiayn.save_pretrained(aiayn.CausalLM(base), tmp_path)
