"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) loads into aiayn's ``CausalLM`` and equals Hugging Face's
class built from a config (random weights, no download): logits within 1e-4 with right and left
padding, grouped-query attention (8 query / 2 key-value heads), fused and separate projections,
tied and untied heads, a sliding window shorter than the sequence; 50 greedy tokens equal HF
``generate``; ``save_pretrained(model_type="phi3")`` writes a checkpoint that ``Phi3ForCausalLM``
loads with equal weights and logits. Also on transformers without Phi-3 (the project's floor): a
Phi-3 layout fused by hand from a ``LlamaForCausalLM`` loads to Llama's logits, and aiayn writes
the same fused tensors back; LongRoPE and partial rotary positions are refused, naming the
setting; a fused tensor with rows the config does not account for is refused."""

from __future__ import annotations

import json

import pytest
import torch

import aiayn
from aiayn.interop import hf_phi3
from aiayn.interop.hf import from_transformers
from aiayn.interop.hf_common import Checkpoint
from hf_helpers import (assert_round_trip, greedy_tokens_and_hf_generate, padded_logits,
                        randomise)

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


LONG_FACTORS = dict(short_factor=[1.0] * 4, long_factor=[4.0] * 4)


@pytest.mark.parametrize("fields", [
    dict(rope_scaling={"type": "longrope", **LONG_FACTORS}),  # Phi-3-mini-128k, Phi-3.5
    dict(rope_scaling={"type": "su", **LONG_FACTORS}),  # early Phi-3-128k configs
    dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **LONG_FACTORS,
                          "original_max_position_embeddings": 32}),  # transformers 5
], ids=["longrope", "su", "rope_parameters"])
def test_longrope_is_refused_naming_the_setting(tmp_path, fields):
    with pytest.raises(ValueError, match=r"config\.json: rope_scaling type '(longrope|su)' "
                                         r"\(LongRoPE.*\) is not supported: .*short_factor"):
        config_of(tmp_path, **fields)


@pytest.mark.parametrize("fields", [
    dict(partial_rotary_factor=0.75),  # Phi-4-mini's config.json
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                          "partial_rotary_factor": 0.5}),  # transformers 5
], ids=["top-level", "rope_parameters"])
def test_partial_rotary_positions_are_refused_naming_the_setting(tmp_path, fields):
    with pytest.raises(ValueError, match=r"config\.json: partial_rotary_factor=0\.(75|5) is not "
                                         r"supported: aiayn rotates every dimension of each head"):
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
    with pytest.raises(ValueError, match=r"rope_scaling type 'linear' is not supported for Phi-3"):
        config_of(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
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
