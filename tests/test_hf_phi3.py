"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) loads into aiayn's ``CausalLM`` and equals Hugging Face's
class built from a config (random weights, no download): logits within 1e-4 with right and left
padding, grouped-query attention (8 query / 2 key-value heads), fused and separate projections,
tied and untied heads, a sliding window shorter than the sequence; 50 greedy tokens equal HF
``generate``; ``save_pretrained(model_type="phi3")`` writes a checkpoint that ``Phi3ForCausalLM``
loads with equal weights and logits. Also on transformers without Phi-3 (the project's floor): a
Phi-3 layout fused by hand from a ``LlamaForCausalLM`` loads to Llama's logits, and aiayn writes
the same fused tensors back; a fused tensor with rows the config does not account for is refused.
Partial rotary positions (Phi-4-mini's ``partial_rotary_factor`` 0.75) and LongRoPE
(Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) over an original context of 16: logits within 1e-4
inside and past it, 50 greedy tokens across it equal ``generate``, round trips; both config
layouts read; bad values refused naming them."""

from __future__ import annotations

import json

import pytest
import torch

import aiayn
from aiayn.interop import hf_phi3
from aiayn.interop.hf import from_transformers
from aiayn.interop.hf_common import Checkpoint
from hf_helpers import (assert_round_trip, greedy_tokens_and_hf_generate, needs_transformers_5,
                        padded_logits, randomise)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
needs_phi3 = pytest.mark.skipif(not hasattr(transformers, "Phi3ForCausalLM"),
                                reason=f"transformers {transformers.__version__} has no Phi-3")

VOCAB, NEW_TOKENS, WINDOW = 97, 50, 8
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_model(std: float = 0.15, **fields):
    config = transformers.Phi3Config(**{**SIZES, "tie_word_embeddings": False, **fields})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    randomise(model, std=std, skip=("rotary_emb",))
    return model


@needs_phi3
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_logits_match_hf_with_right_and_left_padding(fused, tied):
    hf = hf_model(tie_word_embeddings=tied)
    ours = from_transformers(hf, fused_projections=fused)
    config = ours.config
    assert (config.n_heads, config.kv_heads, config.tie_output) == (8, 2, tied)
    assert (config.sliding_window, config.rope_scaling, config.bias) == (None, None, False)
    for got, want, mask in padded_logits(hf, ours, VOCAB, [11, 7, 4]):  # right, then left
        assert want[mask].std() > 0.1  # far from uniform: the test can fail
        assert (got - want)[mask].abs().max() < 1e-4


@needs_phi3
def test_a_sliding_window_matches_hf_past_the_window():
    """A window of 8 over 40 positions, right and left padding; without it the logits differ."""
    hf = hf_model(std=0.3, sliding_window=WINDOW)
    ours = from_transformers(hf)
    assert (ours.config.sliding_window, ours.config.sliding_window_layers) == (WINDOW, None)
    for got, want, mask in padded_logits(hf, ours, VOCAB, [40, 31, 23]):
        assert (got - want)[mask].abs().max() < 1e-4
    unwindowed = from_transformers(hf, sliding_window=None)
    for got, want, mask in padded_logits(hf, unwindowed, VOCAB, [40, 31, 23]):
        assert (got - want)[mask].abs().max() > 1e-2  # the window matters at these lengths


@needs_phi3
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "window-8"])
def test_fifty_greedy_tokens_of_left_padded_prompts_equal_hf_generate(window):
    hf = hf_model(std=0.3, sliding_window=window)
    got, want = greedy_tokens_and_hf_generate(hf, from_transformers(hf), VOCAB,
                                              new_tokens=NEW_TOKENS)
    assert got == want
    assert len({tuple(row) for row in want}) == 3


@needs_phi3
@pytest.mark.parametrize("fields", [dict(), dict(sliding_window=WINDOW, tie_word_embeddings=True)],
                         ids=["untied", "tied-window-8"])
def test_save_pretrained_round_trips_through_transformers(tmp_path, fields):
    hf = hf_model(**fields)
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours", model_type="phi3")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again).__name__ == "Phi3ForCausalLM"
    ids = torch.randint(3, VOCAB, (2, 30))
    assert_round_trip(hf, ours, again, ids, path=tmp_path / "ours")
    # Unasked, the same model is written as the Llama-family class that expresses it
    aiayn.save_pretrained(ours, tmp_path / "default")
    default = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "default").eval()
    assert type(default).__name__ == ("MistralForCausalLM" if "sliding_window" in fields
                                      else "LlamaForCausalLM")
    with torch.no_grad():
        torch.testing.assert_close(default(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def llama_as_phi3(directory):
    """A ``LlamaForCausalLM`` (8 query / 2 key-value heads) and the same weights written by hand
    in Phi-3's layout, each layer's q, k, v and gate, up concatenated by rows (any transformers)."""
    from safetensors.torch import save_file

    llama_fields = {key: value for key, value in SIZES.items()}
    config = transformers.LlamaConfig(**llama_fields, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config).eval()
    randomise(llama, std=0.3, skip=("rotary_emb",))
    state = {name: tensor.contiguous() for name, tensor in llama.state_dict().items()
             if "rotary_emb" not in name}
    for i in range(config.num_hidden_layers):
        attention, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        state[f"{attention}qkv_proj.weight"] = torch.cat(
            [state.pop(f"{attention}{name}_proj.weight") for name in "qkv"])
        state[f"{mlp}gate_up_proj.weight"] = torch.cat(
            [state.pop(f"{mlp}{name}_proj.weight") for name in ("gate", "up")])
    directory.mkdir()
    save_file(state, str(directory / "model.safetensors"))
    phi3 = dict(SIZES, model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_act="silu",
                rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, sliding_window=None,
                tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                attention_dropout=0.0)
    (directory / "config.json").write_text(json.dumps(phi3), encoding="utf-8")
    return llama, state


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_a_phi3_layout_of_llama_weights_gives_llama_logits(tmp_path, fused):
    """Phi-3 is Llama with fused tensors: split on load, fused again on export, bit for bit."""
    from safetensors.torch import load_file

    llama, state = llama_as_phi3(tmp_path / "phi3")
    ours = aiayn.from_pretrained(tmp_path / "phi3", fused_projections=fused)
    for got, want, mask in padded_logits(llama, ours, VOCAB, [11, 7, 4]):
        assert want[mask].std() > 0.1
        assert (got - want)[mask].abs().max() < 1e-4
    aiayn.save_pretrained(ours, tmp_path / "again", model_type="phi3")
    written = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert written.keys() == state.keys()
    for name in state:
        assert torch.equal(written[name], state[name]), name
    config = json.loads((tmp_path / "again" / "config.json").read_text(encoding="utf-8"))
    assert (config["model_type"], config["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
    assert aiayn.from_pretrained(tmp_path / "again", fused_projections=fused).config == ours.config


def test_a_fused_tensor_with_rows_the_config_lacks_is_refused(tmp_path):
    from safetensors.torch import save_file

    _, state = llama_as_phi3(tmp_path / "phi3")
    key = "model.layers.1.mlp.gate_up_proj.weight"
    state[key] = torch.cat([state[key], torch.zeros(4, SIZES["hidden_size"])])
    save_file(state, str(tmp_path / "phi3" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate_up_proj\.weight' has 196 "
                                         r"rows, but aiayn takes .*gate_proj.* rows 0:96, "
                                         r".*up_proj.* rows 96:192"):
        aiayn.from_pretrained(tmp_path / "phi3")


def config_of(tmp_path, **fields):
    """hf_phi3's aiayn config of a Phi-3 config.json with these fields (no weights needed)."""
    config = dict(SIZES, model_type="phi3", architectures=["Phi3ForCausalLM"], **fields)
    return hf_phi3.config_from_hf(config, Checkpoint(tmp_path, config, {}, {}), {})


def factors(count: int, seed: int, high: float) -> list[float]:
    """``count`` random LongRoPE factors in [1, high)."""
    generator = torch.Generator().manual_seed(seed)
    return (1 + (high - 1) * torch.rand(count, generator=generator)).tolist()


# LongRoPE over an original context of 16 of 64 positions; 8 heads of 8: 4 frequencies
LONGROPE = dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": factors(4, 1, 2.0),
                                 "long_factor": factors(4, 2, 8.0)},
                original_max_position_embeddings=16, max_position_embeddings=64)
# Phi-4-mini's layout: 0.75 of each head turns (6 of 8 dims: 3 frequencies), with LongRoPE
PHI4_MINI = dict(partial_rotary_factor=0.75, max_position_embeddings=64,
                 original_max_position_embeddings=16,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.75,
                                  "short_factor": factors(3, 3, 2.0),
                                  "long_factor": factors(3, 4, 8.0)})
# factor and attention_factor given rather than derived (64 / 16 and sqrt(1 + ln 4 / ln 16))
FACTORS = dict(LONGROPE, rope_parameters={**LONGROPE["rope_parameters"], "factor": 8.0,
                                          "attention_factor": 1.25})
ROPES = {"partial-0.75": dict(partial_rotary_factor=0.75), "longrope": LONGROPE,
         "partial-longrope": PHI4_MINI, "longrope-given-factors": FACTORS}
needs_rope_parameters = needs_transformers_5("Phi3Config reads LongRoPE from rope_parameters")


@needs_phi3
@needs_rope_parameters
@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_partial_rotary_and_longrope_logits_match_hf_within_and_past_the_original_context(rope):
    """Rows of up to 11 positions stay inside LongRoPE's original 16 (short factors), rows of up
    to 40 go past it (long factors for the whole call, as transformers picks them)."""
    hf = hf_model(std=0.3, **rope)
    ours = from_transformers(hf)
    fraction = rope.get("partial_rotary_factor", 1.0)
    assert (ours.config.rotary_fraction, ours.config.rotary_dim) == (fraction, int(8 * fraction))
    for lengths in ([11, 7, 4], [40, 31, 23]):
        for got, want, mask in padded_logits(hf, ours, VOCAB, lengths):  # right, then left
            assert want[mask].std() > 0.1
            assert (got - want)[mask].abs().max() < 1e-4
    plain = from_transformers(hf, rotary_fraction=1.0, rope_scaling=None)
    for got, want, mask in padded_logits(hf, plain, VOCAB, [40, 31, 23]):
        assert (got - want)[mask].abs().max() > 1e-2  # the partial / scaled rotation matters


@needs_phi3
@needs_rope_parameters
@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_fifty_greedy_tokens_across_the_original_context_equal_hf_generate(rope):
    """Prompts of 9, 3 and 6 tokens (left-padded to 9) and 50 new: the batch passes LongRoPE's
    original 16 positions, where transformers' Phi-3 generate drops its cache and runs the whole
    sequence again with the long factors; aiayn's generate does the same."""
    hf = hf_model(std=0.3, **rope)
    got, want = greedy_tokens_and_hf_generate(hf, from_transformers(hf), VOCAB,
                                              new_tokens=NEW_TOKENS)
    assert got == want
    assert len({tuple(row) for row in want}) == 3


@needs_phi3
@needs_rope_parameters
@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_partial_rotary_and_longrope_round_trip_through_transformers(tmp_path, rope):
    """Unasked, ``save_pretrained`` writes them as Phi-3, the one class aiayn writes that has
    them; Llama refuses them."""
    hf = hf_model(**rope)
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again).__name__ == "Phi3ForCausalLM"
    written = dict(again.config.rope_parameters)
    assert written.pop("type", "longrope") == "longrope"  # transformers 4's key, kept by 5
    assert written == hf.config.rope_parameters
    ids = torch.randint(3, VOCAB, (2, 30))  # past the original 16
    assert_round_trip(hf, ours, again, ids, path=tmp_path / "ours")
    with pytest.raises(ValueError, match=r"cannot export as llama: a CausalLM with this config "
                                         r"is not a model of that family"):
        aiayn.save_pretrained(ours, tmp_path / "llama", model_type="llama")


SHORT, LONG = [1.0, 1.5, 2.0, 3.0], [2.0, 4.0, 8.0, 16.0]


@pytest.mark.parametrize("kind", ["longrope", "su", "yarn"])
def test_transformers_4_longrope_layout_is_read(tmp_path, kind):
    """Phi-3-mini-128k / Phi-3.5-mini's config.json: ``rope_scaling`` with type, short_factor and
    long_factor (type "su" or "yarn" in early ones), the original context at the top level."""
    config = config_of(tmp_path, rope_scaling={"type": kind, "short_factor": SHORT,
                                               "long_factor": LONG},
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       rope_theta=500.0)
    assert (config.rope_theta, config.rotary_fraction, config.max_length) == (500.0, 1.0, 131072)
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": SHORT,
                                   "long_factor": LONG, "factor": 32.0,
                                   "original_max_position_embeddings": 4096}


def test_transformers_5_layout_is_read_with_phi3s_precedence(tmp_path):
    """rope_parameters with partial_rotary_factor (over the top level's), the original context from
    the top level over the parameters' own (4096, Phi3Config's default, when absent), factor and
    attention_factor when given."""
    rope = {"rope_type": "longrope", "rope_theta": 250000.0, "partial_rotary_factor": 0.5,
            "short_factor": SHORT[:2], "long_factor": LONG[:2], "factor": 8.0,
            "attention_factor": 1.25, "original_max_position_embeddings": 16}
    config = config_of(tmp_path, rope_parameters=rope, partial_rotary_factor=0.75,
                       original_max_position_embeddings=32)
    assert (config.rope_theta, config.rotary_fraction, config.rotary_dim) == (250000.0, 0.5, 4)
    assert config.rope_scaling == {"rope_type": "longrope", "short_factor": SHORT[:2],
                                   "long_factor": LONG[:2], "factor": 8.0,
                                   "attention_factor": 1.25,
                                   "original_max_position_embeddings": 32}
    config = config_of(tmp_path, rope_parameters={**rope, "partial_rotary_factor": 1.0,
                                                  "short_factor": SHORT, "long_factor": LONG})
    assert config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config_of(tmp_path, partial_rotary_factor=0.75).rotary_fraction == 0.75  # Phi-4-mini
    assert config_of(tmp_path, partial_rotary_factor=0.3).rotary_dim == 2  # int(2.4), as in HF


@pytest.mark.parametrize("fields, message", [
    (dict(partial_rotary_factor=0.0), r"partial_rotary_factor=0\.0 must be a number in \(0, 1\]"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.5}),
     r"partial_rotary_factor=1\.5 must be a number in \(0, 1\]"),
    (dict(partial_rotary_factor=0.375), r"rotates 3 dimensions; .* need an even number"),
    (dict(rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]}),
     r"config\.json: rope_scaling long_factor needs one entry per rotary frequency: 4 for a "
     r"rotated width of 8, got 3"),
    (dict(rope_scaling={"type": "su", "short_factor": SHORT}), r"missing \['long_factor'\]"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}),
     r"rope_scaling type 'linear' is not supported for Phi-3"),
], ids=["fraction-0", "fraction-1.5", "odd-rotary-dim", "factor-length",
        "no-long-factor", "linear"])
def test_bad_rotary_settings_are_refused_naming_them(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        config_of(tmp_path, **fields)


def test_what_the_config_holds_is_read(tmp_path):
    config = config_of(tmp_path, sliding_window=2047, resid_pdrop=0.1, attention_dropout=0.05,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=250000.0,
                       rope_parameters={"rope_type": "default", "rope_theta": 250000.0,
                                        "partial_rotary_factor": 1.0})
    assert (config.sliding_window, config.dropout, config.attention_dropout) == (2047, 0.1, 0.05)
    assert (config.layer_norm_eps, config.tie_output, config.rope_theta) == (1e-6, True, 250000.0)
    assert (config.bos_id, config.eos_id, config.pad_id, config.activation) == (1, 2, 0, "silu")
    assert config_of(tmp_path, sliding_window=None).sliding_window is None
    with pytest.raises(ValueError, match=r"resid_pdrop=1\.5 must be in \[0, 1\)"):
        config_of(tmp_path, resid_pdrop=1.5)


def test_what_phi3_cannot_express_is_refused_on_export(tmp_path):
    base = aiayn.TransformerConfig.preset("llama-char")
    with pytest.raises(ValueError, match=r"cannot export as Phi-3: it needs norm='rms'"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(norm="layer")), tmp_path,
                              model_type="phi3")
    with pytest.raises(ValueError, match=r"cannot export as Phi-3: it needs qk_norm=False"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(qk_norm=True)), tmp_path,
                              model_type="phi3")
    with pytest.raises(ValueError, match=r"cannot export as Phi-3: it has no biases"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(qkv_bias=True)), tmp_path,
                              model_type="phi3")
    with pytest.raises(ValueError, match=r"cannot export as Phi-3: it needs "
                                         r"sliding_window_layers=None"):
        aiayn.save_pretrained(aiayn.CausalLM(base.replace(sliding_window=4,
                                                          sliding_window_layers=[0])),
                              tmp_path, model_type="phi3")
    gpt = aiayn.CausalLM(aiayn.TransformerConfig.preset("gpt2", vocab_size=50, d_model=32,
                                                        n_heads=2, d_ff=64, n_decoder_layers=1,
                                                        max_length=16))
    with pytest.raises(ValueError, match=r"cannot export as phi3: a CausalLM with this config"):
        aiayn.save_pretrained(gpt, tmp_path, model_type="phi3")
    with pytest.raises(ValueError, match=r"model_type='gpt_neox' is not one aiayn writes"):
        aiayn.save_pretrained(aiayn.CausalLM(base), tmp_path, model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"cannot export as mistral: the model's config is "
                                         r"written as llama"):
        aiayn.save_pretrained(aiayn.CausalLM(base), tmp_path, model_type="mistral")
    assert not any(tmp_path.iterdir())  # nothing was written
