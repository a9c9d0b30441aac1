"""DistilBERT checkpoints: ``aiayn.from_pretrained`` gives the hidden states and logits ``transformers``
computes from the same files (float32, right-padded batches with a mask, eval mode); a checkpoint
loads with another head; ``aiayn classify`` / ``evaluate`` print what ``transformers`` computes and
``aiayn train classification --init`` fine-tunes one; what aiayn does not load is refused clearly."""

import json

import pytest
import torch

import aiayn
import checkpoint_builders as builders
from aiayn import TransformerConfig
from aiayn.cli import main
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder
from hf_helpers import max_diff_where, padded_ids, randomise

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
VOCAB, LENGTHS = 57, [9, 5, 7]
CONFIGS = {  # two or three layers, several heads, odd widths
    "d36-h3-l2": dict(dim=36, n_heads=3, n_layers=2, hidden_dim=50),
    "d32-h4-l3-relu-5labels": dict(dim=32, n_heads=4, n_layers=3, hidden_dim=40,
                                   activation="relu", num_labels=5),
    # the table is a fixed sinusoid (kept unrandomised below), stored in the file like a learned one
    "d40-h5-l2-sinusoidal": dict(dim=40, n_heads=5, n_layers=2, hidden_dim=44,
                                 sinusoidal_pos_embds=True),
}
ARCHITECTURES = [("DistilBertModel", TransformerEncoder), ("DistilBertForMaskedLM", MaskedLM),
                 ("DistilBertForSequenceClassification", SequenceClassifier)]
TEXTS = ["network proxy server for http clients", "audio player with a mixer",
         "a chess game with a board and puzzles"]


def _save(architecture: str, directory, **changes):
    """A random ``transformers`` DistilBERT model saved to ``directory``, read back by
    ``transformers`` itself (the reference: what a user gets from the same files)."""
    config = transformers.DistilBertConfig(vocab_size=VOCAB, max_position_embeddings=40, **changes)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    skip = ("position_embeddings",) if config.sinusoidal_pos_embds else ()
    randomise(model, skip=skip)
    model.save_pretrained(directory)
    return getattr(transformers, architecture).from_pretrained(directory).eval()


def _output(hf, architecture: str, ids, mask):
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask.long())
    return out.last_hidden_state if architecture == "DistilBertModel" else out.logits


@pytest.mark.parametrize("architecture, aiayn_class", ARCHITECTURES,
                         ids=[name for name, _ in ARCHITECTURES])
@pytest.mark.parametrize("name, fused", [(name, True) for name in CONFIGS] + [("d36-h3-l2", False)],
                         ids=lambda v: {True: "fused-qkv", False: "separate-qkv"}.get(v, v))
def test_distilbert_parity(tmp_path, architecture, aiayn_class, name, fused):
    hf = _save(architecture, tmp_path, **CONFIGS[name])
    ours = aiayn.from_pretrained(tmp_path, fused_projections=fused)
    assert type(ours) is aiayn_class and not ours.training
    assert ours.config.type_vocab_size == 0 and ours.config.layer_norm_eps == 1e-12
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    expected = _output(hf, architecture, ids, mask)
    with torch.no_grad():
        out = ours(ids, padding_mask=mask)
    if aiayn_class is SequenceClassifier:
        assert out.shape == expected.shape == (3, hf.config.num_labels)
        assert (out - expected).abs().max().item() <= TOLERANCE
    else:
        assert max_diff_where(out, expected, mask) <= TOLERANCE


def test_untied_masked_lm_parity(tmp_path):
    hf = _save("DistilBertForMaskedLM", tmp_path, tie_word_embeddings=False,
               **CONFIGS["d36-h3-l2"])
    ours = aiayn.from_pretrained(tmp_path)
    assert ours.head.projection.weight is not ours.encoder.token_embedding.weight
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    with torch.no_grad():
        out = ours(ids, padding_mask=mask)
    assert max_diff_where(out, _output(hf, "DistilBertForMaskedLM", ids, mask), mask) <= TOLERANCE


def test_the_classifier_needs_relu_not_bert_tanh(tmp_path):
    """``pre_classifier`` is followed by ReLU: with BERT's tanh the logits are off by far more than
    the tolerance, so the parity test would catch a missing or wrong activation."""
    hf = _save("DistilBertForSequenceClassification", tmp_path, **CONFIGS["d36-h3-l2"])
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    expected = _output(hf, "DistilBertForSequenceClassification", ids, mask)
    relu = aiayn.from_pretrained(tmp_path)
    tanh = aiayn.from_pretrained(tmp_path, pooler_activation="tanh")
    assert relu.config.pooler_activation == "relu" and isinstance(relu.head.activation, torch.nn.ReLU)
    with torch.no_grad():
        assert (relu(ids, padding_mask=mask) - expected).abs().max().item() <= TOLERANCE
        assert (tanh(ids, padding_mask=mask) - expected).abs().max().item() > 100 * TOLERANCE


def test_a_checkpoint_loads_with_another_head(tmp_path):
    """DistilBertModel weights -> a classifier (pre_classifier and classifier new, as transformers
    starts them); a classifier's or an MLM's weights -> the bare encoder or the other head: the
    encoder is the checkpoint's in every case."""
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    base = _save("DistilBertModel", tmp_path / "base", **CONFIGS["d36-h3-l2"])
    classifier = aiayn.from_pretrained(tmp_path / "base", task="classification", num_labels=4)
    assert classifier.head.classifier.out_features == 4
    assert classifier.config.pooler and classifier.config.pooler_activation == "relu"
    expected = _output(base, "DistilBertModel", ids, mask)
    with torch.no_grad():
        assert max_diff_where(classifier.encoder(ids, padding_mask=mask), expected,
                              mask) <= TOLERANCE
    for architecture, tasks in (("DistilBertForSequenceClassification", ("encoder", "masked_lm")),
                                ("DistilBertForMaskedLM", ("encoder", "classification"))):
        hf = _save(architecture, tmp_path / architecture, **CONFIGS["d36-h3-l2"])
        expected = _output(hf.distilbert, "DistilBertModel", ids, mask)
        for task in tasks:
            model = aiayn.from_pretrained(tmp_path / architecture, task=task)
            encoder = model if task == "encoder" else model.encoder
            with torch.no_grad():
                hidden = encoder(ids, padding_mask=mask)
            assert max_diff_where(hidden, expected, mask) <= TOLERANCE, (architecture, task)


def test_models_are_still_saved_as_bert(tmp_path):
    """DistilBERT loads only: an aiayn encoder model is written as BERT, exactly as before, and a
    model loaded from DistilBERT (no token types, a ReLU pooler) is refused by BERT's checks."""
    config = TransformerConfig(vocab_size=40, d_model=24, n_heads=3, d_ff=30, n_encoder_layers=2,
                               n_decoder_layers=0, max_length=16, positions="learned",
                               scale_embeddings=False, embedding_norm=True, type_vocab_size=2,
                               activation="gelu", layer_norm_eps=1e-12, pooler=True)
    aiayn.save_pretrained(SequenceClassifier(config), tmp_path / "bert")
    saved = json.loads((tmp_path / "bert" / "config.json").read_text())
    assert saved["model_type"] == "bert"
    assert saved["architectures"] == ["BertForSequenceClassification"]
    _save("DistilBertForSequenceClassification", tmp_path / "distil", **CONFIGS["d36-h3-l2"])
    with pytest.raises(ValueError, match=r"cannot export as BERT: BERT needs "
                                         r"pooler_activation='tanh', the model has "
                                         r"pooler_activation='relu'"):
        aiayn.save_pretrained(aiayn.from_pretrained(tmp_path / "distil"), tmp_path / "out")
    with pytest.raises(ValueError, match=r"cannot export as BERT: .*type_vocab_size=0"):
        aiayn.save_pretrained(aiayn.from_pretrained(tmp_path / "distil", task="encoder"),
                              tmp_path / "out")


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return builders.distilbert_classifier(tmp_path_factory.mktemp("hf") / "distilbert", TEXTS * 3)


def test_classify_and_evaluate_print_what_transformers_computes(classifier_dir, tmp_path, capsys):
    tokenizer = transformers.AutoTokenizer.from_pretrained(classifier_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    assert type(model).__name__ == "DistilBertForSequenceClassification"
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert tokenizer.unk_token_id not in batch["input_ids"]  # the words are in the vocabulary
    with torch.no_grad():
        probabilities = model(input_ids=batch["input_ids"],
                              attention_mask=batch["attention_mask"]).logits.softmax(-1)
    names = [model.config.id2label[i] for i in probabilities.argmax(-1).tolist()]
    assert main(["classify", str(classifier_dir), *[a for t in TEXTS for a in ("--text", t)]]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in rows] == names
    for row, expected in zip(rows, probabilities.max(-1).values.tolist()):
        assert float(row[1]) == pytest.approx(expected, abs=6e-5)
    data = tmp_path / "labelled.tsv"
    labels = builders.LABELS[::-1]
    data.write_text("text\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in zip(TEXTS, labels)),
                    encoding="utf-8")
    assert main(["evaluate", str(classifier_dir), "--data", str(data), "--split", "all"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    right = sum(name == label for name, label in zip(names, labels))
    assert scored["rows"] == 3 and scored["accuracy"] == pytest.approx(right / 3)


def test_embed_and_attention_run_on_the_checkpoint(classifier_dir, tmp_path):
    """``embed``: the L2-normalised mean of DistilBERT's last hidden states over the real tokens
    (sentence-transformers' recipe); ``attention`` draws the maps with the checkpoint's tokens."""
    import numpy

    tokenizer = transformers.AutoTokenizer.from_pretrained(classifier_dir)
    model = transformers.AutoModel.from_pretrained(classifier_dir).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).last_hidden_state
    weights = batch["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    assert main(["embed", str(classifier_dir), "--input", str(texts), "--output",
                 str(tmp_path / "x.npy")]) == 0
    got = torch.from_numpy(numpy.load(tmp_path / "x.npy"))
    assert got.shape == expected.shape and (got - expected).abs().max().item() <= TOLERANCE
    assert main(["attention", str(classifier_dir), "--text", TEXTS[0], "--out",
                 str(tmp_path / "maps"), "--dpi", "40"]) == 0
    assert (tmp_path / "maps" / "metrics.json").is_file()


def test_train_classification_from_a_distilbert_checkpoint(classifier_dir, tmp_path):
    words = {"net": TEXTS[0], "sound": TEXTS[1], "games": TEXTS[2]}
    data = tmp_path / "train.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{' '.join(text.split()[i:] or text.split())}\t"
                                              f"{label}\n" for label, text in words.items()
                                              for i in range(8)), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "classification", "--data", str(data), "--out", str(out), "--init",
                 str(classifier_dir), "--steps", "2", "--batch-size", "4", "--max-tokens", "16",
                 "--eval-every", "2", "--save-every", "2", "--log-every", "1", "--threads", "1",
                 "--no-progress", "--autocast", "none"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["assets"]["init"] == f"hugging face {classifier_dir}"
    checkpoint = json.loads((classifier_dir / "config.json").read_text())
    assert run["model_config"]["vocab_size"] == checkpoint["vocab_size"]
    assert run["model_config"]["type_vocab_size"] == 0


def _edit_config(directory, **changes):
    path = directory / "config.json"
    config = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({key: value for key, value in config.items() if value is not None}))


@pytest.mark.parametrize("architecture", ["DistilBertForQuestionAnswering",
                                          "DistilBertForTokenClassification",
                                          "DistilBertForMultipleChoice"])
def test_unsupported_heads_are_refused(tmp_path, architecture):
    _save("DistilBertModel", tmp_path, **CONFIGS["d36-h3-l2"])
    _edit_config(tmp_path, architectures=[architecture])
    with pytest.raises(ValueError, match=rf"config\.json: architectures=\['{architecture}'\] is not "
                                         rf"supported; aiayn loads DistilBertModel, "
                                         rf"DistilBertForMaskedLM, "
                                         rf"DistilBertForSequenceClassification"):
        aiayn.from_pretrained(tmp_path)


def test_bad_settings_are_refused_naming_the_file(tmp_path):
    _save("DistilBertModel", tmp_path, **CONFIGS["d36-h3-l2"])
    with pytest.raises(ValueError, match="a DistilBERT checkpoint loads as one of "
                                         r"\['classification', 'encoder', 'masked_lm'\], not "
                                         "task='causal_lm'"):
        aiayn.from_pretrained(tmp_path, task="causal_lm")
    with pytest.raises(ValueError, match=r"config\.json: DistilBERT has no token-type embeddings, "
                                         r"so type_vocab_size=2 cannot be loaded"):
        aiayn.from_pretrained(tmp_path, type_vocab_size=2)
    with pytest.raises(ValueError, match=r"config\.json: pooler_activation must be one of "
                                         r"\['tanh', 'relu', 'gelu', 'gelu_tanh', 'silu'\], "
                                         r"got 'mish'"):
        aiayn.from_pretrained(tmp_path, pooler_activation="mish")
    _edit_config(tmp_path, activation="mish")
    with pytest.raises(ValueError, match=r"config\.json: activation='mish' is not supported"):
        aiayn.from_pretrained(tmp_path)
    _edit_config(tmp_path, activation="gelu", n_heads=5)
    with pytest.raises(ValueError, match=r"config\.json: d_model \(36\) must be divisible by "
                                         r"n_heads \(5\)"):
        aiayn.from_pretrained(tmp_path)
    _edit_config(tmp_path, n_heads=3, dim=None)
    with pytest.raises(ValueError, match=r"config\.json: missing field 'dim'"):
        aiayn.from_pretrained(tmp_path)
    _edit_config(tmp_path, dim=40)
    with pytest.raises(ValueError, match=r"model\.safetensors: shape mismatch .*"
                                         r"'embeddings\.word_embeddings\.weight' \(57, 36\)"):
        aiayn.from_pretrained(tmp_path, n_heads=4)
