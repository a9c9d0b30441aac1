"""The Llama-shaped families load into the same ``CausalLM`` and equal Hugging Face's classes built
from configs (random weights, no download): Mistral (a sliding window), Qwen2 (biases on q, k, v
only: ``qkv_bias``), Qwen3 (RMSNorm on each head's q and k: ``qk_norm``), and their sliding windows
(``sliding_window``, ``sliding_window_layers``). Logits within 1e-4 with
right and left padding, fused and separate projections; round trips through ``save_pretrained``
that transformers loads as the same class; 50 greedy tokens equal HF ``generate``; sliding windows
(every layer, or some) past the window, padded and generating; what a family cannot express is
refused."""

from __future__ import annotations

import pytest
import torch

import aiayn
from aiayn.decoding.generation import generate
from aiayn.interop.hf import from_transformers
from hf_helpers import (assert_round_trip, greedy_tokens_and_hf_generate, left_padded,
                        needs_transformers_5, padded_logits, randomise)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, NEW_TOKENS = 97, 50
# family -> (config class, model class, what is special about it)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, use_sliding_window=False)),
}


def family_param(name: str):
    present = hasattr(transformers, FAMILIES[name][1])
    return pytest.param(name, marks=pytest.mark.skipif(
        not present, reason=f"transformers {transformers.__version__} has no {FAMILIES[name][1]}"))


ALL = [family_param(name) for name in FAMILIES]


def hf_model(family: str, std: float = 0.15, **fields):
    config_class, model_class, special = FAMILIES[family]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, **{**special, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomise(model, std=std, skip=("rotary_emb",))
    return model


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_logits_match_hf_with_right_and_left_padding(family, fused):
    hf = hf_model(family)
    ours = from_transformers(hf, fused_projections=fused)
    config = ours.config
    assert (config.qkv_bias, config.qk_norm) == {"mistral": (None, False), "qwen2": (True, False),
                                                 "qwen3": (None, True)}[family]
    for got, want, mask in padded_logits(hf, ours, VOCAB, [11, 7, 4]):  # right, then left
        assert want[mask].std() > 0.1  # far from uniform: the test can fail
        assert (got - want)[mask].abs().max() < 1e-4


@pytest.mark.parametrize("family", ALL)
def test_save_pretrained_round_trips_through_transformers(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    # Mistral without a window is Llama: it is written as Llama
    want_class = "LlamaForCausalLM" if family == "mistral" else FAMILIES[family][1]
    assert type(again).__name__ == want_class
    assert_round_trip(hf, ours, again, torch.randint(3, VOCAB, (2, 9)), path=tmp_path / "ours")


@pytest.mark.parametrize("family", ALL)
def test_fifty_greedy_tokens_of_left_padded_prompts_equal_hf_generate(family):
    hf = hf_model(family, std=0.3)
    ours = from_transformers(hf)
    got, want = greedy_tokens_and_hf_generate(hf, ours, VOCAB, new_tokens=NEW_TOKENS)
    assert got == want
    assert len({tuple(row) for row in want}) == 3


WINDOWS = [  # a window of 8 over 40 positions; Qwen's on layer 1 alone (max_window_layers=1)
    pytest.param("mistral", dict(sliding_window=8), None, marks=ALL[0].marks, id="mistral"),
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
                 [1], marks=ALL[1].marks, id="qwen2-layer-1"),
    pytest.param("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
                 None, marks=ALL[2].marks, id="qwen3-all"),
]


@needs_transformers_5("4.40's SDPA mask gives padded rows another sliding window than unpadded "
                      "ones (an unpadded batch matches)")
@pytest.mark.parametrize("family, fields, layers", WINDOWS)
def test_a_sliding_window_matches_hf_past_the_window(family, fields, layers):
    """Logits at 40 positions with right and left padding (the window counts cache slots, padding
    included, as transformers counts them), and 50 greedy tokens of left-padded prompts."""
    hf = hf_model(family, std=0.3, **fields)
    ours = from_transformers(hf)
    assert (ours.config.sliding_window, ours.config.sliding_window_layers) == (8, layers)
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):  # right, then left
        assert (got - want)[mask].abs().max() < 1e-4
    unwindowed = from_transformers(hf, sliding_window=None, sliding_window_layers=None)
    for got, want, mask in padded_logits(hf, unwindowed, VOCAB, [40, 31, 23]):
        assert (got - want)[mask].abs().max() > 1e-2  # the window matters at these lengths
    prompts, mask = left_padded(VOCAB, [9, 3, 6], seed=5)
    got = generate(ours, [row[m].tolist() for row, m in zip(prompts, mask)],
                   max_new_tokens=NEW_TOKENS, greedy=True).tokens
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(prompts, attention_mask=mask.long(), do_sample=False, num_beams=1,
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    assert got == out[:, prompts.shape[1]:].tolist()


@pytest.mark.parametrize("family, fields, layers", WINDOWS)
def test_a_window_round_trips_through_transformers(tmp_path, family, fields, layers):
    hf = hf_model(family, **fields)
    ours = from_transformers(hf)
    aiayn.save_pretrained(ours, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again).__name__ == FAMILIES[family][1]  # Mistral with a window stays Mistral
    assert aiayn.from_pretrained(tmp_path).config == ours.config
    ids = torch.randint(3, VOCAB, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_a_qwen2_window_that_is_switched_off_is_not_applied():
    hf = hf_model("qwen2", use_sliding_window=False, sliding_window=16)
    assert from_transformers(hf).config.sliding_window is None


def config_json(tmp_path, **fields):
    config = dict(architectures=["Qwen3ForCausalLM"], vocab_size=VOCAB, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, **fields)
    checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
    return lambda: aiayn.interop.hf_llama.config_from_hf(config, checkpoint, {})


def test_what_a_family_cannot_express_is_refused(tmp_path):
    with pytest.raises(ValueError, match="attention_bias=True with mlp_bias=False"):
        config_json(tmp_path, model_type="qwen3", attention_bias=True)()
    base = aiayn.TransformerConfig.preset("llama-char")
    with pytest.raises(ValueError, match="cannot export as Qwen3 .* bias=True"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(qk_norm=True, bias=True)), tmp_path)
    with pytest.raises(ValueError, match="Llama has biases on every projection or on none"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(bias=True, qkv_bias=False)), tmp_path)
    with pytest.raises(ValueError, match="cannot export as Mistral: Mistral slides on every layer"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(sliding_window=4,
                                                          sliding_window_layers=[0])), tmp_path)
