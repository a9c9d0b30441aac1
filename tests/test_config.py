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


def test_every_flag_must_be_a_bool_so_json_strings_are_refused(tmp_path):
    """Each bool field (and each bool-or-None field) refuses a string, a number and None where
    None is not allowed: "false" read from a JSON file used to switch the feature on."""
    import dataclasses
    import json

    flags = [f for f in dataclasses.fields(TransformerConfig) if f.type in ("bool", "bool | None")]
    assert {"bias", "tie_output", "norm_first", "qk_norm", "final_norm"} <= {f.name for f in flags}
    for field in flags:
        for value in ("false", 0, 1.0) + ((None,) if field.type == "bool" else ()):
            with pytest.raises(ValueError, match=f"^{field.name} must be true or false"):
                TransformerConfig.preset("tiny", **{field.name: value})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TransformerConfig.preset("tiny").to_dict(), "bias": "false"}))
    with pytest.raises(ValueError, match="bias must be true or false, got 'false'"):
        TransformerConfig.load(path)
    for field, value in (("layer_norm_eps", True), ("dropout", True), ("rope_theta", True)):
        with pytest.raises(ValueError, match=f"{field} must be"):
            TransformerConfig.preset("tiny", **{field: value})


@pytest.mark.parametrize("fields, words", [
    (dict(positions="rotary", position_offset=2),
     "position_offset numbers the rows of a position table; positions='rotary' has none"),
    (dict(positions="none", position_offset=1), "positions='none' has none"),
    (dict(relative_attention_max_distance=7),
     "relative_attention_max_distance=7 sizes a relative position bias, which "
     "relative_attention_buckets=0 turns off"),
    (dict(sliding_window=4, sliding_window_layers=[]),
     "sliding_window_layers=[] names no layer, so the sliding_window would apply nowhere"),
])
def test_a_field_the_model_would_ignore_is_refused(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        TransformerConfig.preset("tiny", **fields)


def test_fields_a_model_family_would_ignore_are_refused_when_it_is_built():
    """Checked where the config alone cannot tell: a sliding layer past the stack actually built
    (the config's check takes the deeper of encoder and decoder), a logit cap on class logits,
    a position offset on the ViT's patch positions."""
    from aiayn import CausalLM, ImageClassifier, SequenceClassifier, TransformerEncoder

    base = dict(vocab_size=50, d_model=32, n_heads=4, d_ff=64, max_length=40, dropout=0.0)
    decoder = TransformerConfig(**base, n_encoder_layers=6, n_decoder_layers=2, sliding_window=2,
                                sliding_window_layers=[4, 5])
    with pytest.raises(ValueError, match=re.escape(
            "sliding_window_layers=[4, 5] names layer 5, but this stack has 2 layers")):
        CausalLM(decoder)
    with pytest.raises(ValueError, match="names layer 3, but this stack has 2 layers"):
        TransformerEncoder(decoder.replace(n_encoder_layers=2, n_decoder_layers=6,
                                           sliding_window_layers=[3]))
    CausalLM(decoder.replace(sliding_window_layers=[1]))  # within the stack: built
    for model in (SequenceClassifier, ImageClassifier):
        config = (TransformerConfig.preset("vit-digits") if model is ImageClassifier
                  else TransformerConfig(**base, num_labels=3))
        with pytest.raises(ValueError, match="logit_softcap=30.0 caps a language model's "
                                             "vocabulary logits; a classification head"):
            model(config.replace(logit_softcap=30.0))
    with pytest.raises(ValueError, match="patch embedding has no position_offset"):
        ImageClassifier(TransformerConfig.preset("vit-digits", position_offset=2))


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

