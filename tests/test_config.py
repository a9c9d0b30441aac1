import dataclasses
import json
import re

import pytest
import torch

from aiayn import PRESETS, CausalLM, Transformer, TransformerConfig, TransformerEncoder, count_parameters


@pytest.mark.parametrize("name, paper_millions", [("base", 65), ("big", 213)])
def test_paper_presets_match_table_3_parameter_counts(name, paper_millions):
    config = TransformerConfig.preset(name, vocab_size=37000)
    count = count_parameters(Transformer(config))
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.05, count


def test_presets_are_the_papers_rows():
    base, big = TransformerConfig.preset("base"), TransformerConfig.preset("big")
    assert (base.n_encoder_layers, base.d_model, base.d_ff, base.n_heads, base.dropout) == (
        6, 512, 2048, 8, 0.1)
    assert (big.n_encoder_layers, big.d_model, big.d_ff, big.n_heads, big.dropout) == (
        6, 1024, 4096, 16, 0.3)
    assert base.head_dim == 64 and big.head_dim == 64
    assert {"base", "big", "tiny"} <= set(PRESETS)


def test_tied_matrices_are_one_parameter():
    model = Transformer(TransformerConfig.preset("tiny"))
    shared = model.generator.weight
    assert model.encoder.embeddings.tokens.weight is shared
    assert model.decoder.embeddings.tokens.weight is shared
    untied = Transformer(TransformerConfig.preset("tiny", tie_source_target=False, tie_output=False))
    weights = {id(untied.generator.weight), id(untied.encoder.embeddings.tokens.weight),
               id(untied.decoder.embeddings.tokens.weight)}
    assert len(weights) == 3
    assert count_parameters(untied) - count_parameters(model) == 2 * 100 * 32


@pytest.mark.parametrize("field, value, words", [
    ("d_model", 30, "divisible by n_heads"),
    ("d_model", -8, "d_model must be a positive integer"),
    ("n_heads", 0, "n_heads must be a positive integer"),
    ("d_ff", 0, "d_ff"),
    ("n_encoder_layers", -1, "n_encoder_layers"),
    ("vocab_size", 0, "vocab_size"),
    ("max_length", 0, "max_length"),
    ("dropout", 1.0, "dropout must be in [0, 1)"),
    ("dropout", -0.1, "dropout must be in [0, 1)"),
    ("attention_dropout", 1.5, "attention_dropout"),
    ("activation", "tanh", "activation must be one of"),
    ("positions", "alibi", "positions must be one of"),
    ("attention", "magic", "attention must be one of"),
    ("pooling", "max", "pooling must be one of"),
    ("layer_norm_eps", 0.0, "layer_norm_eps"),
    ("pad_id", 100, "pad_id must be a token id"),
    ("init_std", -1.0, "init_std"),
    ("scaled_residual_init", True, "scaled_residual_init scales init_std .* it needs init_std"),
    ("attention_scale", 0, "attention_scale must be a positive number or None, got 0"),
    ("attention_scale", -0.125, "attention_scale must be a positive number or None, got -0.125"),
    ("attention_scale", True, "attention_scale must be a positive number or None, got True"),
    ("attention_scale", float("inf"), "attention_scale must be a positive number or None"),
    ("attention_scale", "0.1", "attention_scale must be a positive number or None, got '0.1'"),
])
def test_invalid_fields_raise_value_error_naming_them(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace(")", r"\)")):
        TransformerConfig.preset("tiny", **{field: value})


@pytest.mark.parametrize("fields, words", [
    (dict(attention_scale=0.125, scale_attention=False),
     "attention_scale=0.125 and scale_attention=False both set the score scale; set "
     "attention_scale alone"),
    (dict(attention="linear", attention_scale=1.0),
     "attention_scale=1.0 means nothing to attention='linear' (its feature map has no softmax "
     "scale)"),
    (dict(attention="linear", scale_attention=False),
     "scale_attention=False means nothing to attention='linear'"),
])
def test_an_attention_scale_the_kernel_cannot_use_is_refused(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        TransformerConfig.preset("tiny", **fields)


def test_unknown_preset_and_unknown_key():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        TransformerConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown config key.*d_modle"):
        TransformerConfig.from_dict({"d_modle": 3})


def test_json_round_trip(tmp_path):
    config = TransformerConfig.preset("tiny", norm_first=True, activation="gelu")
    config.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json") == config
    (tmp_path / "bad.json").write_text('{"d_model": 30, "n_heads": 4}')
    with pytest.raises(ValueError, match="bad.json.*divisible"):
        TransformerConfig.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not a valid JSON"):
        TransformerConfig.load(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        TransformerConfig.load(tmp_path / "missing.json")


def test_attention_scale_round_trips_and_old_files_without_it_load(tmp_path):
    config = TransformerConfig.preset("tiny", attention_scale=144 ** -0.5)
    assert TransformerConfig.from_dict(config.to_dict()) == config
    config.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json").attention_scale == 144 ** -0.5
    old = {k: v for k, v in TransformerConfig.preset("tiny").to_dict().items()
           if k != "attention_scale"}  # a file written before the field existed
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert TransformerConfig.load(tmp_path / "old.json").attention_scale is None


def test_derived_fields_and_keyword_only():
    config = TransformerConfig.preset("tiny", norm_first=True)
    assert config.final_norm is True and config.src_vocab_size == config.vocab_size
    assert config.decoder_start_id == config.bos_id
    with pytest.raises(TypeError):
        TransformerConfig(512)  # keyword-only
    assert dataclasses.replace(config, d_model=64).d_model == 64


def test_family_layer_counts_follow_config():
    config = TransformerConfig.preset("tiny", n_encoder_layers=3, n_decoder_layers=1)
    assert len(TransformerEncoder(config).encoder.layers) == 3
    assert len(CausalLM(config).decoder.layers) == 1


def test_replace_keeps_derived_fields_following_their_source():
    config = TransformerConfig.preset("tiny")
    bigger = config.replace(vocab_size=500)
    assert bigger.src_vocab_size == 500
    assert config.replace(norm_first=True).final_norm is True
    assert config.replace(bos_id=5).decoder_start_id == 5
    explicit = TransformerConfig.preset("tiny", tie_source_target=False, src_vocab_size=40)
    assert explicit.replace(vocab_size=500).src_vocab_size == 40  # set on purpose: kept
    marian = TransformerConfig.preset("tiny", decoder_start_id=0)
    assert marian.replace(bos_id=3).decoder_start_id == 0


def test_scaled_residual_init_counts_the_layers_the_model_has():
    """GPT-2's std / sqrt(2 * layers) over the layers built: a decoder-only model built from a
    config that also counts encoder layers is initialised as one without them."""
    def residual_std(config):
        torch.manual_seed(0)
        model = CausalLM(config)
        return torch.cat([m.weight.flatten() for name, m in model.named_modules()
                          if name.endswith(("out_proj", "linear2"))]).std().item()

    base = TransformerConfig.preset("tiny", d_model=64, d_ff=256, init_std=0.02,
                                    scaled_residual_init=True, n_decoder_layers=2)
    alone = residual_std(base.replace(n_encoder_layers=0))
    assert alone == pytest.approx(0.02 / 2, rel=0.05)  # 2 layers: 0.02 / sqrt(4)
    assert residual_std(base.replace(n_encoder_layers=10)) == alone

