"""ModernBERT checkpoints (``aiayn.interop.hf_modernbert``) against ``transformers`` built from a
small config (random weights, no download): hidden states, masked-LM logits and classifier logits
(first-token and mean pooling) within 1e-4 at every real position of right-padded rows longer than
the local window, on transformers' SDPA and eager attention, with 5 layers (global, local, local,
global, local) and two RoPE bases; both config layouts (transformers 5's ``layer_types`` /
``rope_parameters``, 4's ``global_attn_every_n_layers`` / ``*_rope_theta``) read as transformers
reads them; heads a checkpoint lacks; round trips through ``save_pretrained``; the commands on a
checkpoint directory; refusals naming the field. On transformers without ModernBERT (the project's
floor) only the tests that need no transformers model run."""

from __future__ import annotations

import json

import pytest
import torch

import aiayn
from aiayn import MaskedLM, SequenceClassifier, TransformerConfig, TransformerEncoder
from aiayn.cli import main
from hf_helpers import assert_round_trip, padded_ids, randomise

import checkpoint_builders as builders

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
needs_modernbert = pytest.mark.skipif(not hasattr(transformers, "ModernBertConfig"),
                                      reason=f"transformers {transformers.__version__} has no "
                                             f"ModernBERT")

VOCAB, LOCAL = 97, 8  # local layers see keys at most LOCAL // 2 = 4 away
LENGTHS = [30, 17, 5]  # right padding; 30 positions: far past the window
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=5,
             num_attention_heads=4, max_position_embeddings=64, local_attention=LOCAL,
             global_attn_every_n_layers=3, global_rope_theta=1000.0, local_rope_theta=50.0,
             pad_token_id=0, bos_token_id=1, cls_token_id=1, eos_token_id=2, sep_token_id=2,
             num_labels=3)
KINDS = ("Model", "ForMaskedLM", "ForSequenceClassification")
ATTENTION = ["sdpa", "eager"]


def hf_model(kind: str = "Model", *, attention: str = "sdpa", seed: int = 0, **fields):
    config = transformers.ModernBertConfig(**{**SIZES, **fields}, attn_implementation=attention)
    torch.manual_seed(seed)
    model = getattr(transformers, f"ModernBert{kind}")(config).eval()
    randomise(model, std=0.2, skip=("rotary",))
    with torch.no_grad():  # gains away from 1, so a norm applied in the wrong place shows
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    return model


def saved(model, directory):
    model.save_pretrained(directory)
    return directory


@torch.no_grad()
def outputs(hf, ours, lengths=LENGTHS):
    """(aiayn's, transformers') outputs on right-padded rows, real positions only: (N, ...)."""
    ids, mask = padded_ids(VOCAB, lengths, pad=0)
    out = hf(ids, attention_mask=mask.long())
    want = out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits
    got = ours(ids, padding_mask=mask)
    return (got[mask], want[mask]) if want.dim() == 3 else (got, want)


@needs_modernbert
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("kind", KINDS)
def test_outputs_equal_transformers(kind, attention, tmp_path):
    hf = hf_model(kind, attention=attention)
    ours = aiayn.from_pretrained(saved(hf, tmp_path / "hf"))
    assert type(ours) is {"Model": TransformerEncoder, "ForMaskedLM": MaskedLM,
                          "ForSequenceClassification": SequenceClassifier}[kind]
    config = ours.config
    assert (config.sliding_window, config.sliding_window_layers) == (LOCAL // 2 + 1, [1, 2, 4])
    assert (config.rope_theta, config.rope_local_theta) == (1000.0, 50.0)
    assert not config.first_attention_norm and not config.bias and not config.layer_norm_bias
    got, want = outputs(hf, ours)
    assert want.std() > 0.1  # far from constant: the test can fail
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@needs_modernbert
@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("biases", [False, True], ids=["bias-free", "biases"])
def test_classifier_pooling_and_biases_equal_transformers(pooling, biases):
    """Mean pooling over the real tokens only; every bias ModernBERT can switch on."""
    flags = dict.fromkeys(("attention_bias", "mlp_bias", "norm_bias", "classifier_bias"), biases)
    hf = hf_model("ForSequenceClassification", classifier_pooling=pooling, **flags)
    ours = aiayn.from_transformers(hf)
    assert ours.config.pooling == {"cls": "first", "mean": "mean"}[pooling]
    assert (ours.head.pooler.bias is not None) == biases
    got, want = outputs(hf, ours)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    got, want = outputs(hf_model("ForMaskedLM", decoder_bias=not biases, **flags),
                        aiayn.from_transformers(hf_model("ForMaskedLM", decoder_bias=not biases,
                                                         **flags)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@needs_modernbert
def test_the_band_and_the_local_rope_base_matter_and_separate_projections_load():
    hf = hf_model()
    for changes in (dict(sliding_window=None, sliding_window_layers=None, rope_local_theta=None),
                    dict(rope_local_theta=None)):
        got, want = outputs(hf, aiayn.from_transformers(hf, **changes))
        assert (got - want).abs().max() > 1e-2, changes
    got, want = outputs(hf, aiayn.from_transformers(hf, fused_projections=False))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@needs_modernbert
def test_both_config_layouts_load_as_transformers_reads_them(tmp_path):
    """transformers 5's layout alone, 4's alone, and both disagreeing (5's wins, as in
    transformers): each to the layer types and RoPE bases ``ModernBertConfig`` reads."""
    directory = saved(hf_model(), tmp_path / "hf")
    written = json.loads((directory / "config.json").read_text())
    legacy = ("global_attn_every_n_layers", "global_rope_theta", "local_rope_theta")
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 3000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}
    variants = {
        "5": {k: v for k, v in written.items() if k not in legacy},
        "4": {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}
        | {"global_rope_theta": 1000.0, "local_rope_theta": 50.0},
        "both": written | {"global_attn_every_n_layers": 2, "global_rope_theta": 7.0,
                           "local_rope_theta": 9.0, "rope_parameters": rope,
                           "layer_types": ["full_attention", "sliding_attention",
                                           "full_attention", "full_attention",
                                           "sliding_attention"]},
        "4-two": {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}
        | {"global_attn_every_n_layers": 2, "local_rope_theta": 30.0},
    }
    for name, config in variants.items():
        (directory / "config.json").write_text(json.dumps(config))
        reference = transformers.ModernBertConfig.from_pretrained(directory)
        ours = aiayn.from_pretrained(directory).config
        sliding = [i for i, kind in enumerate(reference.layer_types) if kind == "sliding_attention"]
        assert ours.sliding_window_layers == sliding, name
        thetas = reference.rope_parameters
        assert ours.rope_theta == thetas["full_attention"]["rope_theta"], name
        assert ours.rope_local_theta == thetas["sliding_attention"]["rope_theta"], name
    assert ours.sliding_window_layers == [1, 3] and ours.rope_theta == 160000.0  # "4-two"
    (directory / "config.json").write_text(json.dumps(variants["4"] | {"local_rope_theta": None}))
    assert aiayn.from_pretrained(directory).config.rope_local_theta is None  # 4: the global base


@needs_modernbert
def test_heads_a_checkpoint_lacks_are_new_and_the_mlm_head_serves_the_classifier(tmp_path):
    """As transformers: a bare model gets a fresh classification head; a masked-LM checkpoint
    loaded for classification keeps ``head.dense`` / ``head.norm`` (the two heads share them) and
    gets a fresh classifier; loaded as an encoder, it drops its head."""
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    for kind in ("Model", "ForMaskedLM"):
        directory = saved(hf_model(kind), tmp_path / kind)
        ours = aiayn.from_pretrained(directory, task="classification")
        reference = transformers.ModernBertForSequenceClassification.from_pretrained(
            directory).eval()
        with torch.no_grad():
            if kind == "ForMaskedLM":  # the shared head came from the file in both
                torch.testing.assert_close(ours.head.pooler.weight, reference.head.dense.weight)
            reference.head.dense.weight.copy_(ours.head.pooler.weight)
            reference.head.norm.weight.copy_(ours.head.norm.weight)
            reference.classifier.load_state_dict(ours.head.classifier.state_dict())
            torch.testing.assert_close(ours(ids, padding_mask=mask),
                                       reference(ids, attention_mask=mask.long()).logits,
                                       rtol=0, atol=1e-4)
    encoder = aiayn.from_pretrained(tmp_path / "ForMaskedLM", task="encoder")
    reference = transformers.ModernBertModel.from_pretrained(tmp_path / "ForMaskedLM").eval()
    got, want = outputs(reference, encoder)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@needs_modernbert
@pytest.mark.parametrize("kind", ["ForMaskedLM", "ForSequenceClassification"])
def test_round_trip_loads_in_transformers_with_the_same_weights(kind, tmp_path):
    hf = hf_model(kind, classifier_pooling="mean", tie_word_embeddings=kind == "ForMaskedLM")
    ours = aiayn.from_transformers(hf)
    path = aiayn.save_pretrained(ours, tmp_path / "out")
    written = json.loads((path / "config.json").read_text())
    assert written["model_type"] == "modernbert" and written["architectures"] == [f"ModernBert{kind}"]
    assert written["global_attn_every_n_layers"] == 3 and written["local_attention"] == LOCAL
    assert written["layer_types"][:3] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert written["local_rope_theta"] == written["rope_parameters"]["sliding_attention"][
        "rope_theta"] == 50.0
    again = getattr(transformers, f"ModernBert{kind}").from_pretrained(path).eval()
    ids, _ = padded_ids(VOCAB, [30, 30], pad=0)
    assert_round_trip(hf, ours, again, ids, path=path)


@needs_modernbert
def test_a_bare_encoder_round_trips(tmp_path):
    hf = hf_model(global_attn_every_n_layers=2, local_rope_theta=1000.0)
    ours = aiayn.from_transformers(hf)
    assert ours.config.rope_local_theta is None  # the same base as the global layers
    again = transformers.ModernBertModel.from_pretrained(aiayn.save_pretrained(ours, tmp_path))
    got, want = outputs(again.eval(), ours)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert again.config.layer_types == hf.config.layer_types


# --- without transformers' ModernBERT (the floor too) --------------------------------------------
def modernbert_config(**changes) -> TransformerConfig:
    """An aiayn config with ModernBERT's shape: 4 layers (global, local, local, global)."""
    return TransformerConfig(**{**dict(
        vocab_size=50, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=4, n_decoder_layers=0,
        max_length=64, dropout=0.0, activation="gelu", norm_first=True, final_norm=True,
        first_attention_norm=False, positions="rotary", rope_theta=1000.0, gated_ffn=True,
        embedding_norm=True, scale_embeddings=False, type_vocab_size=0, bias=False,
        layer_norm_bias=False, sliding_window=5, sliding_window_layers=[1, 2],
        rope_local_theta=50.0, pooler=True, pooler_activation="gelu", pooler_norm=True,
        head_bias=False, init_std=0.02), **changes})


@pytest.mark.parametrize("window", [5, 1])  # local_attention 8; 0 (each token sees itself)
@pytest.mark.parametrize("model", [TransformerEncoder, MaskedLM, SequenceClassifier])
def test_aiayn_writes_and_reads_back_its_own_modernbert_config(model, window, tmp_path):
    config = modernbert_config(output_bias=model is MaskedLM, pooler=model is SequenceClassifier,
                               sliding_window=window)
    ours = model(config).eval()
    path = aiayn.save_pretrained(ours, tmp_path)
    written = json.loads((path / "config.json").read_text())
    assert written["local_attention"] == 2 * (window - 1)
    assert written["global_attn_every_n_layers"] == 3
    again = aiayn.from_pretrained(path)
    assert again.config == config
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ours(ids), rtol=0, atol=0)


@pytest.mark.parametrize("changes, message", [
    (dict(norm_first=False, first_attention_norm=True), "ModernBERT needs norm_first=True"),
    (dict(first_attention_norm=True), "ModernBERT needs first_attention_norm=False"),
    (dict(gated_ffn=False), "ModernBERT needs gated_ffn=True"),
    (dict(n_kv_heads=2), "ModernBERT needs n_kv_heads=None"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "needs rope_scaling=None"),
    (dict(sliding_window_layers=[2, 3]), r"layer i is global exactly when i % n == 0 .* the "
                                          r"model's sliding layers are \[2, 3\]"),
    (dict(sliding_window_layers=None), r"sliding layers are \[0, 1, 2, 3\]"),
    (dict(pooler_norm=False), "ModernBERT needs pooler_norm=True"),
    (dict(pooler_activation="tanh"), "ModernBERT needs pooler_activation='gelu'"),
])
def test_configs_modernbert_cannot_express_are_refused_naming_the_field(changes, message,
                                                                         tmp_path):
    model = SequenceClassifier(modernbert_config(**changes))
    with pytest.raises(ValueError, match=f"cannot export as ModernBERT: .*{message}"):
        aiayn.save_pretrained(model, tmp_path)


def test_bert_refuses_modernberts_heads(tmp_path):
    bert = dict(positions="learned", norm_first=False, first_attention_norm=True,
                sliding_window=None, sliding_window_layers=None, rope_local_theta=None,
                gated_ffn=False, type_vocab_size=2, final_norm=False, bias=True,
                layer_norm_bias=True, pooler_activation="tanh")
    with pytest.raises(ValueError, match="cannot export as BERT: BERT needs head_bias=True"):
        aiayn.save_pretrained(SequenceClassifier(modernbert_config(**bert)), tmp_path)
    with pytest.raises(ValueError, match="cannot export as BERT: BERT needs pooler_norm=False"):
        aiayn.save_pretrained(SequenceClassifier(modernbert_config(**bert, head_bias=True)),
                              tmp_path)


@pytest.mark.parametrize("changes, message", [
    (dict(classifier_activation="silu"), "classifier_activation='silu' differs from "
                                         "hidden_activation='gelu'"),
    (dict(attention_bias=True), "attention_bias=True and mlp_bias=False differ"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0}}),
     "RoPE type 'linear' \\(full_attention\\) is not supported"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0}),
     "rope_parameters must map \\['full_attention', 'sliding_attention'\\]"),
    (dict(layer_types=["full_attention", "chunked_attention", "full_attention",
                       "full_attention"]), "layer_types=.* must list"),
    (dict(layer_types=["full_attention"]), r"layer_types=\['full_attention'\] must list .* for "
                                           r"each of the 4 layers"),
    (dict(global_attn_every_n_layers=0, layer_types=None), "global_attn_every_n_layers=0 must "
                                                           "be a positive integer"),
    (dict(classifier_pooling="max"), "classifier_pooling='max' is not supported"),
    (dict(local_attention=-2), "local_attention=-2 must be a non-negative integer"),
    (dict(hidden_activation="mish"), "hidden_activation='mish' is not supported"),
])
def test_modernbert_settings_aiayn_lacks_are_refused_naming_the_field(changes, message, tmp_path):
    path = aiayn.save_pretrained(SequenceClassifier(modernbert_config()), tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ValueError, match=f"config\\.json: {message}"):
        aiayn.from_pretrained(path)


def test_sparse_prediction_and_kernel_settings_load_and_change_nothing(tmp_path):
    ours = SequenceClassifier(modernbert_config()).eval()
    path = aiayn.save_pretrained(ours, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | dict(
        sparse_prediction=True, deterministic_flash_attn=True, reference_compile=False)))
    assert aiayn.from_pretrained(path).config == ours.config


# --- the commands on a ModernBERT directory ------------------------------------------------------
TEXTS = ["a game of chess for two players", "the network daemon serves files",
         "play sounds from the command line"]


def modernbert_classifier(directory):
    """ModernBERT's tokenizer layout ([CLS] X [SEP], a byte-level BPE) and a classifier."""
    from tokenizers import processors

    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tokenizer = builders._byte_level_bpe(TEXTS * 5 + [t for pair in builders.pairs(300)
                                                      for t in pair], 300, specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        unk_token="[UNK]", mask_token="[MASK]")
    fast.save_pretrained(directory)
    labels = dict(enumerate(builders.LABELS))
    hf = hf_model("ForSequenceClassification", vocab_size=len(fast), pad_token_id=3,
                  classifier_pooling="mean", id2label=labels,
                  label2id={name: i for i, name in labels.items()})
    return saved(hf, directory), fast, hf


@needs_modernbert
def test_classify_fine_tune_and_embed_with_a_modernbert_directory(tmp_path, capsys):
    directory, tokenizer, hf = modernbert_classifier(tmp_path / "hf")
    with torch.no_grad():
        probabilities = hf(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits.softmax(-1)
    assert main(["classify", str(directory), *[a for t in TEXTS for a in ("--text", t)]]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in rows] == [builders.LABELS[i] for i in probabilities.argmax(-1)]
    for row, expected in zip(rows, probabilities.max(-1).values.tolist()):
        assert float(row[1]) == pytest.approx(expected, abs=1e-4)

    data = tmp_path / "labelled.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{t} {n}\t{label}\n" for n in range(8)
                                              for t, label in zip(TEXTS, builders.LABELS)),
                    encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "classification", "--data", str(data), "--out", str(run), "--init",
                 str(directory), "--steps", "2", "--batch-size", "8", "--threads", "1",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["classify", str(run), "--text", TEXTS[0]]) == 0
    assert capsys.readouterr().out.split("\t")[0] in builders.LABELS

    inputs = tmp_path / "texts.txt"
    inputs.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    assert main(["embed", str(directory), "--input", str(inputs)]) == 0
    printed = torch.tensor([[float(x) for x in line.split()]
                            for line in capsys.readouterr().out.splitlines()])
    encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf.model(**encoded).last_hidden_state  # (N, T, D)
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(printed, expected, rtol=0, atol=1e-4)
