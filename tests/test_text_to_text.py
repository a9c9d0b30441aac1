"""Text-to-text (issue 32): translation and classification examples as prefixed text for one T5-style
model; ``aiayn train text2text`` and ``aiayn evaluate`` end to end on tiny files (the bundled-data
run is in docs/t5.md)."""

from __future__ import annotations

import json

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.cli import main
from aiayn.data.tokenizer import SubwordTokenizer
from aiayn.tasks.text_to_text import (TextExample, TextToTextTask, classification_examples,
                                      score_examples)

WORDS = ["red", "green", "blue", "house", "tree", "cat", "dog", "big", "small", "old"]
GERMAN = ["rot", "grün", "blau", "Haus", "Baum", "Katze", "Hund", "groß", "klein", "alt"]


def write_data(tmp_path):
    translation = tmp_path / "pairs.tsv"
    lines = ["en\tde\tsplit"]
    for i in range(60):
        a, b = i % 10, (i * 3 + 1) % 10
        split = "test" if i % 10 == 0 else "valid" if i % 10 == 1 else "train"
        lines.append(f"the {WORDS[a]} {WORDS[b]}\tdie {GERMAN[a]} {GERMAN[b]}\t{split}")
    translation.write_text("\n".join(lines) + "\n", encoding="utf-8")
    classification = tmp_path / "labels.tsv"
    rows = ["text\tlabel"] + [f"a {WORDS[i % 5]} thing number {i}\t{'colour' if i % 5 < 3 else 'place'}"
                              for i in range(60)]
    classification.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return translation, classification


def test_examples_are_prefixed_text_and_long_classification_sources_are_cut():
    from aiayn.data.labelled_tsv import LabelledTexts

    rows = LabelledTexts(texts=("word " * 50, "short"), labels=("a", "b"), lines=(2, 3),
                         splits=None, source="x")
    examples = classification_examples(rows, "section: ")
    assert examples[1] == TextExample("section: short", "b", "classification")
    tokenizer = SubwordTokenizer.train([e.source for e in examples] + ["a", "b"], vocab_size=60)
    task = TextToTextTask(train=examples, valid=examples, tokenizer=tokenizer,
                          prefixes={"classification": "section: "}, max_length=10)
    assert max(map(len, task.train_source)) == 10 and len(task.train_source) == 2


def test_accuracy_is_the_share_of_generated_labels_equal_to_the_label_text(monkeypatch):
    from aiayn.tasks import text_to_text

    examples = [TextExample(f"s: {i}", label, "classification")
                for i, label in enumerate(["admin", "libs", "admin", "net"])]
    monkeypatch.setattr(text_to_text, "generate_texts",
                        lambda *args, **kwargs: [" admin", "libs ", "net", "netx"])
    assert score_examples(None, None, examples) == {"accuracy": 0.5}
    with pytest.raises(ValueError, match="one kind of example at a time"):
        score_examples(None, None, examples + [TextExample("t: x", "y", "translation")])


def test_the_query_init_folds_in_the_score_scale_without_scale_attention():
    torch.manual_seed(0)
    scaled = Transformer(TransformerConfig.preset("t5-cpu", vocab_size=100, scale_attention=True))
    torch.manual_seed(0)
    folded = Transformer(TransformerConfig.preset("t5-cpu", vocab_size=100))
    for a, b in zip(scaled.modules(), folded.modules()):
        if hasattr(a, "qkv_proj"):
            rows = a.split_sizes[0]
            torch.testing.assert_close(b.qkv_proj.weight[:rows], a.qkv_proj.weight[:rows] * 32 ** -0.5)
            torch.testing.assert_close(b.qkv_proj.weight[rows:], a.qkv_proj.weight[rows:])
        elif hasattr(a, "q_proj"):
            torch.testing.assert_close(b.q_proj.weight, a.q_proj.weight * 32 ** -0.5)


@pytest.mark.slow  # two short trainings and their evaluations (~half a minute)
def test_train_and_evaluate_text_to_text_from_the_command_line(tmp_path, capsys, monkeypatch):
    translation, classification = write_data(tmp_path)
    common = ["--translation-data", str(translation), "--classification-data",
              str(classification), "--steps", "30", "--eval-every", "30", "--save-every", "30",
              "--set", "d_model=32", "--set", "d_ff=64", "--set", "n_encoder_layers=1",
              "--set", "n_decoder_layers=1", "--vocab-size", "120", "--max-tokens", "400",
              "--threads", "1", "--no-progress", "--valid-sentences", "5"]
    run_dir = tmp_path / "both"
    assert main(["train", "text2text", "--out", str(run_dir), *common]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"bleu", "chrf", "accuracy", "loss"} <= set(summary)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["model_config"]["relative_attention_buckets"] == 32
    assert info["training_config"]["lr_scales"] == {  # the recipe's factor on unit-scale weights
        "encoder.embeddings.": 30.0, "decoder.embeddings.": 30.0, "encoder.position_bias.": 30.0,
        "decoder.position_bias.": 30.0, "generator.": 30.0}
    assert info["assets"]["prefixes"] == {"translation": "translate English to German: ",
                                          "classification": "debian section: "}
    written = tmp_path / "outputs.txt"
    assert main(["evaluate", str(run_dir), "--data", str(translation), str(classification),
                 "--beam", "1", "--output", str(written)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["translation"]["examples"] == 6 and 0 <= result["translation"]["bleu"] <= 100
    assert result["classification"]["examples"] == 6  # the stratified 10 % test rows
    assert 0 <= result["classification"]["accuracy"] <= 1
    # --output: the generated texts, file by file, which score to the printed figures
    from aiayn.commands.train_text_to_text import examples, splits
    from aiayn.tasks.text_to_text import score_outputs

    lines = written.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 12 + 1 and lines[-1] == ""
    prefixes = json.loads((run_dir / "run.json").read_text())["assets"]["prefixes"]
    for kind, path, outputs in (("translation", translation, lines[:6]),
                                ("classification", classification, lines[6:12])):
        rows = list(examples(kind, splits(kind, path)["test"], prefixes[kind]))
        scores = {k: v for k, v in result[kind].items() if k not in ("data", "examples")}
        assert score_outputs(outputs, rows) == scores

    single = tmp_path / "translation-only"
    assert main(["train", "text2text", "--out", str(single), "--tasks", "translation",
                 *common]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(single), "--data", str(classification)]) == 1
    assert "trained on ['translation'] only" in capsys.readouterr().err

    # aiayn translate puts the run's translation prefix before each line (an empty one stays
    # empty): what evaluate's generation gives for the prefixed sources.
    import io
    import sys

    from aiayn.tasks.checkpoints import load_model_dir
    from aiayn.tasks.text_to_text import generate_texts

    sentences = ["the red house", "", "the old dog"]
    run = load_model_dir(run_dir, task="text2text")
    prefix = run.assets.prefixes["translation"]
    want = generate_texts(run.model, run.assets.tokenizer, [prefix + s for s in sentences if s],
                          beam_size=4)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(
        "".join(s + "\n" for s in sentences).encode("utf-8"))))
    assert main(["translate", str(run_dir), "--threads", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == [want[0], "", want[1]]
    labels_only = tmp_path / "classification-only"
    assert main(["train", "text2text", "--out", str(labels_only), "--tasks", "classification",
                 *common]) == 0
    capsys.readouterr()
    assert main(["translate", str(labels_only)]) == 1
    assert "trained on ['classification'] only: it does not translate" in \
        capsys.readouterr().err

    # aiayn classify on a text2text run: the label evaluate's generation gives (prefix, beam 4)
    # and the model's probability of that label text
    import math

    from aiayn.tasks.text_to_text import MAX_EXTRA, generate_ids, output_log_probs

    texts = ["a red thing number 7", "a house thing number 9"]
    run = load_model_dir(labels_only, task="text2text")
    prefixed = [run.assets.prefixes["classification"] + text for text in texts]
    options = dict(beam_size=4, max_extra=MAX_EXTRA["classification"], max_length=128)
    labels = generate_texts(run.model, run.assets.tokenizer, prefixed, **options)  # as evaluate
    sources, outputs = generate_ids(run.model, run.assets.tokenizer, prefixed, **options)
    assert run.assets.tokenizer.decode(outputs) == labels
    probabilities = [math.exp(v) for v in output_log_probs(run.model, sources, outputs)]
    assert main(["classify", str(labels_only), *[a for t in texts for a in ("--text", t)]]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{label.strip()}\t{p:.4f}" for label, p in zip(labels, probabilities)]
    assert main(["classify", str(labels_only), "--top", "2", "--text", texts[0]]) == 1
    assert "a text2text run generates one label per text" in capsys.readouterr().err
    assert main(["classify", str(single), "--text", texts[0]]) == 1
    assert "trained on ['translation'] only: it does not classify" in capsys.readouterr().err


def test_embedding_lr_scale_covers_exactly_the_weights_t5_starts_at_unit_scale():
    """The recipe's prefixes name every weight initialise() starts at N(0, 1) (token embeddings,
    both relative-position tables, an untied output matrix, untied source and target embeddings)
    and nothing else; without scale_output those start small and get no factor."""
    import argparse

    from aiayn.commands.train import EMBEDDING_LR_SCALE, embedding_lr_scales
    from aiayn.training.optimizer import lr_scale

    def scales(*sets, factor=10.0, preset="t5-cpu", init=None):
        return embedding_lr_scales(argparse.Namespace(preset=preset, set=list(sets),
                                                      embedding_lr_scale=factor, init=init))

    recipe = scales()
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("t5-cpu", vocab_size=2000, tie_output=False,
                                                 tie_source_target=False))
    for name, p in model.named_parameters():
        unit = p.dim() == 2 and abs(p.std().item() - 1) < 0.1
        assert lr_scale(name, recipe) == (10.0 if unit else 1.0), name
    assert {name for name, p in model.named_parameters() if lr_scale(name, recipe) == 10} >= {
        "encoder.embeddings.tokens.weight", "decoder.embeddings.tokens.weight",
        "encoder.position_bias.embedding.weight", "decoder.position_bias.embedding.weight",
        "generator.weight"}
    assert scales("scale_output=false") == {} and scales("init_std=0.02") == {}
    assert scales(factor=1.0) == {} and scales(preset="mt-cpu") == {}
    # unset: the recipe's factor from scratch, none for a fine-tuned model unless asked
    assert scales(factor=None) == {prefix: EMBEDDING_LR_SCALE for prefix in recipe}
    assert scales(factor=None, init="runs/pretrained") == {}
    assert scales(factor=3.0) == {prefix: 3.0 for prefix in recipe}
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="--embedding-lr-scale must be a positive number"):
            scales(factor=bad)


def test_output_log_probs_equal_the_beam_search_scores_of_its_hypotheses():
    """Teacher-forced log P(output, </s> | source), batched with padding, equals what the cached
    beam search (alpha 0) scored the same outputs, on a T5-style model with relative bias."""
    from aiayn.decoding.beam import beam_search
    from aiayn.tasks.text_to_text import output_log_probs

    torch.manual_seed(0)
    config = TransformerConfig.preset("t5-cpu", vocab_size=40, d_model=32, d_ff=64, n_heads=4,
                                      n_encoder_layers=2, n_decoder_layers=2, dropout=0.3,
                                      pad_id=0, eos_id=1, bos_id=0)
    model = Transformer(config).eval()
    sources = [[5, 9, 3, 7], [12, 4], [30, 31, 32, 33, 34, 35, 36], [8]]
    length = max(map(len, sources)) + 1
    padded = torch.tensor([row + [1] + [0] * (length - len(row) - 1) for row in sources])
    with torch.no_grad():
        hypotheses = beam_search(model, padded, padded != 0, beam_size=3, alpha=0.0, max_extra=6)
    model.train()  # scored in eval mode (no dropout), then left as it was
    got = output_log_probs(model, sources, [h.tokens for h in hypotheses], max_tokens=12)
    assert got == pytest.approx([h.score for h in hypotheses], abs=1e-4)
    assert model.training and all(value < 0 for value in got)


def test_generation_cuts_classification_sources_as_training_did_and_reads_translations_whole(
        tmp_path, monkeypatch):
    """A classification source is cut to the run's --max-length subwords in validation, evaluate
    and classify alike (the run records it; an older run.json without it: 128); a translation
    source reaches the model whole, as ``aiayn translate`` gives it."""
    from aiayn.tasks import translate
    from aiayn.tasks.text_to_text import MAX_SOURCE_LENGTH, generate_examples
    from aiayn.training.validation import evaluate_model

    long_text = " ".join(WORDS[i % 10] for i in range(200))
    examples = [TextExample("c: " + long_text, "colour", "classification"),
                TextExample("t: " + long_text, "die " + GERMAN[0], "translation")]
    tokenizer = SubwordTokenizer.train([long_text, "colour", "die rot", "c: t:"], vocab_size=60)
    task = TextToTextTask(train=examples, valid=examples, tokenizer=tokenizer,
                          prefixes={"classification": "c: ", "translation": "t: "},
                          max_length=12, valid_sentences=5)
    torch.manual_seed(0)
    model = task.build_model(task.model_config(TransformerConfig.preset(
        "t5-cpu", vocab_size=60, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1,
        n_decoder_layers=1)))
    seen = []
    real = translate.translate_ids

    def spy(model, ids, **options):
        seen.append([len(row) for row in ids])
        return real(model, ids, **options)

    monkeypatch.setattr(translate, "translate_ids", spy)
    whole = len(tokenizer.encode(["t: " + long_text])[0])
    assert whole > MAX_SOURCE_LENGTH
    evaluate_model(model, task)  # as the trainer validates: translations first, then labels
    assert seen == [[whole], [12]]
    seen.clear()
    generate_examples(model, tokenizer, examples[1:], max_length=12)
    assert seen == [[whole]]

    (tmp_path / "run.json").write_text(json.dumps({"assets": task.save_assets(tmp_path)}))
    assert TextToTextTask.load_assets(tmp_path).max_length == 12
    (tmp_path / "run.json").write_text(json.dumps({"assets": {}}))  # a run from before
    assert TextToTextTask.load_assets(tmp_path).max_length == MAX_SOURCE_LENGTH


def test_evaluate_tells_labelled_texts_from_pairs_by_header_or_by_the_run(tmp_path):
    from aiayn.commands.train_text_to_text import kind_of

    both = {"translation": "t: ", "classification": "c: "}
    files = {"labelled": "text\tlabel\na red thing\tcolour\n", "pairs": "en\tde\nred\trot\n",
             "split": "src\ttgt\tsplit\nred\trot\ttrain\n", "bare": "a red thing\tcolour\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert kind_of(tmp_path / "labelled", both) == "classification"
    assert kind_of(tmp_path / "pairs", both) == kind_of(tmp_path / "split", both) == "translation"
    # no header: the run's one kind (a headerless labelled TSV on a classification run) ...
    assert kind_of(tmp_path / "bare", {"classification": "c: "}) == "classification"
    assert kind_of(tmp_path / "bare", {"translation": "t: "}) == "translation"
    # ... and for a run of both, a clear error rather than BLEU of labels
    with pytest.raises(ValueError, match="bare: no header says whether it holds translation "
                                         "pairs or labelled texts"):
        kind_of(tmp_path / "bare", both)
