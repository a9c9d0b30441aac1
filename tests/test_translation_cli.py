"""``aiayn train translation`` / ``translate`` / ``evaluate``: errors, and a tiny end-to-end run."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.cli import main

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "ddtp_en_de.tsv.gz"
TINY = ["--preset", "tiny", "--set", "max_length=256", "--vocab-size", "120", "--max-tokens",
        "400", "--warmup", "2", "--valid-bleu-sentences", "2", "--no-progress", "--threads", "2"]


@pytest.fixture(scope="module")
def tiny_tsv(tmp_path_factory):
    """60 real pairs of the bundled corpus (header + split column kept)."""
    lines = gzip.decompress(BUNDLED.read_bytes()).decode("utf-8").splitlines()
    header, rows = lines[0], [line for line in lines[1:] if len(line) < 160]
    rows = [r for r in rows if r.endswith("\ttrain")][:50] + \
        [r for r in rows if r.endswith("\ttest")][:10]
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    path.write_text("\n".join([header] + rows) + "\n", encoding="utf-8")
    return path


def train_args(data, out, *extra):
    return ["train", "translation", "--data", str(data), "--out", str(out), *TINY, *extra]


def test_missing_and_empty_data_files(tmp_path, capsys):
    assert main(train_args(tmp_path / "nope.tsv", tmp_path / "run")) == 1
    assert "data file not found" in capsys.readouterr().err
    (tmp_path / "empty.tsv").write_text("")
    assert main(train_args(tmp_path / "empty.tsv", tmp_path / "run")) == 1
    assert "empty.tsv: the file is empty" in capsys.readouterr().err


def test_malformed_line_names_file_and_line(tmp_path, capsys):
    (tmp_path / "bad.tsv").write_text("Hello\tHallo\nno tab here\n")
    assert main(train_args(tmp_path / "bad.tsv", tmp_path / "run")) == 1
    assert "bad.tsv:2: expected at least 2 tab-separated fields" in capsys.readouterr().err


def test_translate_and_evaluate_reject_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["translate", str(tmp_path)]) == 1
    assert "is not an aiayn run directory" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "nope"), "--data", "x.tsv"]) == 1
    assert "run directory not found" in capsys.readouterr().err


def test_corrupt_checkpoint_is_reported_and_the_previous_one_stays(tiny_tsv, tmp_path, capsys):
    out = tmp_path / "run"
    fast = ("--valid-bleu-sentences", "0", "--best-metric", "loss", "--best-mode", "min")
    assert main(train_args(tiny_tsv, out, "--steps", "2", "--save-every", "1",
                           "--eval-every", "0", *fast)) == 0
    capsys.readouterr()
    step1 = out / "checkpoints" / "step-1"
    before = {p.name: p.read_bytes() for p in step1.iterdir()}
    weights = out / "checkpoints" / "step-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    assert main(train_args(tiny_tsv, out, "--steps", "4", "--save-every", "1", *fast)) == 1
    err = capsys.readouterr().err
    assert "step-2" in err and ("corrupt" in err or "checksum" in err)
    assert {p.name: p.read_bytes() for p in step1.iterdir()} == before
    (out / "model.safetensors").write_bytes(b"garbage")
    assert main(["evaluate", str(out), "--data", str(tiny_tsv)]) == 1
    assert "model.safetensors" in capsys.readouterr().err


@pytest.mark.slow
def test_train_translate_evaluate_end_to_end(tiny_tsv, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(tiny_tsv, out, "--steps", "6", "--eval-every", "3",
                           "--save-every", "3")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 6 and "bleu" in summary
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    info = json.loads((out / "run.json").read_text())
    assert info["task"] == "translation" and info["assets"]["tokenizer"] == "tokenizer.json"
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid"] == [3, 6]

    result = subprocess.run([sys.executable, "-m", "aiayn", "translate", str(out), "--beam", "2"],
                            input="This package contains the data files.\n\nHello world\n",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one output line per input

    assert main(["evaluate", str(out), "--data", str(tiny_tsv), "--beam", "1", "--limit", "4"]) == 0
    scores = json.loads(capsys.readouterr().out.strip())
    assert scores["split"] == "test" and scores["sentences"] == 4 and scores["beam"] == 1
    assert 0.0 <= scores["bleu"] <= 100.0 and 0.0 <= scores["chrf"] <= 100.0


@pytest.mark.slow  # two fresh interpreters, one of them compiling the decoding step
def test_translate_compile_option_prints_the_eager_translations(tiny_tsv, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(tiny_tsv, out, "--steps", "6", "--eval-every", "0",
                           "--save-every", "0")) == 0
    text = "This package contains the data files.\nHello world\n"
    outputs = [subprocess.run([sys.executable, "-m", "aiayn", "translate", str(out), "--beam", "2",
                               *extra], input=text, capture_output=True, text=True, timeout=300)
               for extra in ([], ["--compile"])]
    assert all(result.returncode == 0 for result in outputs), outputs[1].stderr
    assert outputs[1].stdout == outputs[0].stdout and len(outputs[0].stdout.split("\n")) == 3


@pytest.mark.parametrize("device, cuda_available, expected", [
    ("cpu", False, "cpu"), ("cpu", True, "cpu"), ("cuda", True, "cuda"), (None, True, "cuda"),
    (None, False, "cpu")])
def test_the_recipe_follows_the_training_device(device, cuda_available, expected, monkeypatch):
    """The CUDA recipe (more steps, averaged checkpoints, bf16 where native) on a CUDA device, named
    or found; the CPU recipe elsewhere; what the command line sets stays."""
    import torch

    from aiayn.cli import build_parser
    from aiayn.commands.train import training_config_from_args
    from aiayn.commands.train_translation import CPU_RECIPE, CUDA_RECIPE, apply_recipe

    from aiayn.training import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    # bf16 where native: every CUDA card here, no CPU
    monkeypatch.setattr(precision, "native_bf16",
                        lambda device, *args: torch.device(device).type == "cuda")
    command = ["train", "translation", "--data", "x.tsv", "--out", "run"]
    args = build_parser().parse_args(command + (["--device", device] if device else []))
    recipe = CUDA_RECIPE if expected == "cuda" else CPU_RECIPE
    assert apply_recipe(args) == recipe
    assert {name: getattr(args, name) for name in recipe} == recipe
    config = training_config_from_args(args, 128)
    assert (config.steps, config.eval_every, config.save_every, config.average_last) == (
        recipe["steps"], recipe["eval_every"], recipe["save_every"], recipe["average_last"])
    assert config.autocast == ("bf16" if expected == "cuda" else None)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda is checked
    given = build_parser().parse_args(command + ["--steps", "7", "--average-last", "0",
                                                 "--autocast", "none", "--device", "cuda"])
    apply_recipe(given)
    assert (given.steps, given.average_last, given.autocast, given.eval_every) == (
        7, 0, "none", CUDA_RECIPE["eval_every"])

    # FSDP: the same recipe, checkpoint averaging included (every rank evaluates the average).
    sharded = build_parser().parse_args(command + ["--device", "cuda", "--distributed", "fsdp"])
    apply_recipe(sharded)
    assert (sharded.average_last, sharded.steps) == (CUDA_RECIPE["average_last"],
                                                     CUDA_RECIPE["steps"])
    assert training_config_from_args(sharded, 128).average_last == CUDA_RECIPE["average_last"]


def test_the_help_gives_both_recipes(capsys):
    with pytest.raises(SystemExit):
        main(["train", "translation", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "optimizer updates (default: 3000 on the CPU, 20000 on CUDA)" in help_text
    assert "(default: 0 on the CPU, 5 on CUDA)" in help_text


def test_a_validation_pair_longer_than_the_position_table_is_left_out(tiny_tsv, tmp_path,
                                                                      capsys):
    """Training pairs are filtered by --max-length, validation pairs are not: one too long for the
    model's table used to end the run at its first evaluation, before any checkpoint."""
    long_source = " ".join(["This package contains the documentation."] * 80)
    long_target = " ".join(["Dieses Paket enthält die Dokumentation."] * 80)
    data = tmp_path / "long-valid.tsv"
    data.write_text(tiny_tsv.read_text(encoding="utf-8").replace("\ttest\n", "\tvalid\n")
                    + f"{long_source}\t{long_target}\tx\tsentence\tvalid\n", encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "translation", "--data", str(data), "--out", str(out), "--preset",
                 "tiny", "--vocab-size", "120", "--max-tokens", "400", "--steps", "4",
                 "--eval-every", "4", "--save-every", "4", "--valid-bleu-sentences", "0",
                 "--best-metric", "loss", "--best-mode", "min", "--no-progress", "--threads",
                 "2"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["model_config"]["max_length"] < 400  # the long pair does not fit the table
    assert (out / "checkpoints" / "step-4").is_dir()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["loss"] > 0


def test_training_pairs_left_out_are_counted_on_stderr_and_in_run_json(tiny_tsv, tmp_path,
                                                                      capsys):
    """Pairs over --max-length or --max-ratio are dropped from training, and the command says how
    many (the count run.json records), with the limits that dropped them; none: no line."""
    words = "This package contains the documentation for the library."
    data = tmp_path / "long.tsv"
    data.write_text(tiny_tsv.read_text(encoding="utf-8")
                    + f"{' '.join([words] * 30)}\t{' '.join([words] * 30)}\tx\tx\ttrain\n"
                    + f"{words}\t{' '.join([words] * 8)}\tx\tx\ttrain\n", encoding="utf-8")
    out = tmp_path / "run"
    assert main(train_args(data, out, "--steps", "1", "--max-length", "64",
                           "--max-ratio", "3")) == 0
    err = capsys.readouterr().err
    dropped = json.loads((out / "run.json").read_text())["assets"]["filtered_pairs"]
    assert dropped >= 2  # the two added, and any of the tiny vocabulary's longest
    assert f"translation: {dropped} of 52 training pairs left out: longer than 64 subwords on a " \
           f"side (--max-length), a length ratio above 3.0 (--max-ratio) or no subwords" in err
    assert main(train_args(tiny_tsv, tmp_path / "clean", "--steps", "1")) == 0
    assert "left out" not in capsys.readouterr().err
    assert json.loads((tmp_path / "clean" / "run.json").read_text())["assets"][
        "filtered_pairs"] == 0


def test_a_best_metric_the_evaluation_will_not_report_is_refused_before_training(
        tiny_tsv, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(tiny_tsv, out, "--valid-bleu-sentences", "0", "--steps", "4")) == 1
    assert "best_metric 'bleu' is not among the task's metrics ['loss', 'ppl']" in \
        capsys.readouterr().err
    assert not out.exists()  # nothing trained, nothing written
    for option, value, message in [("--label-smoothing", "1.5", "must be in [0, 1), got 1.5"),
                                   ("--valid-bleu-sentences", "-1", "must be non-negative")]:
        assert main(train_args(tiny_tsv, out, option, value, "--steps", "4")) == 1
        assert f"{option} {message}" in capsys.readouterr().err
        assert not out.exists()


def test_evaluate_without_a_split_column_scores_every_row_or_the_hash_split_asked_for(
        tiny_tsv, tmp_path, capsys):
    """A test set given as two files is scored whole; ``--split test`` on data without a split
    column is the hash split training used (2 % test), not every row (training pairs included)."""
    from aiayn.data.parallel import read_pairs, split_pairs

    out = tmp_path / "run"
    assert main(train_args(tiny_tsv, out, "--steps", "2", "--save-every", "2")) == 0
    rows = [line.split("\t")[:2] for line in tiny_tsv.read_text(encoding="utf-8").splitlines()[1:]]
    many = rows * 8  # 480 pairs: a few sources hash into the test split
    (tmp_path / "src.en").write_text("".join(s + "\n" for s, _ in many), encoding="utf-8")
    (tmp_path / "tgt.de").write_text("".join(t + "\n" for _, t in many), encoding="utf-8")
    files = [str(tmp_path / "src.en"), str(tmp_path / "tgt.de")]
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", *files, "--beam", "1"]) == 0
    whole = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (whole["split"], whole["split_by"], whole["sentences"]) == ("all", "none", 480)
    assert main(["evaluate", str(out), "--data", *files, "--beam", "1", "--split", "test"]) == 0
    test = json.loads(capsys.readouterr().out.splitlines()[-1])
    expected = len(split_pairs(read_pairs(files))["test"])
    assert (test["split"], test["split_by"], test["sentences"]) == ("test", "hash", expected)
    assert 0 < expected < 480


def test_a_t5_style_model_gets_the_embedding_learning_rate_factor(tiny_tsv, tmp_path):
    """As in text2text, a T5-style model (output rescaled, weights started at unit scale) trains
    its unit-scale weights at 30x the learning rate, or --embedding-lr-scale's factor; the paper's
    model and a model fine-tuned from --init get no factor unless asked."""
    t5 = ["--set", "scale_output=true"]
    runs = {"paper": [], "t5": t5, "t5x3": [*t5, "--embedding-lr-scale", "3"],
            "tuned": ["--init", str(tmp_path / "t5")],
            "tuned-x2": ["--init", str(tmp_path / "t5"), "--embedding-lr-scale", "2"]}
    scales = {}
    for name, extra in runs.items():
        assert main(train_args(tiny_tsv, tmp_path / name, "--steps", "1", *extra)) == 0
        run = json.loads((tmp_path / name / "run.json").read_text())
        scales[name] = run["training_config"]["lr_scales"]
    assert scales["paper"] == {} and scales["tuned"] == {}
    assert scales["t5"] == dict.fromkeys(["decoder.embeddings.", "decoder.position_bias.",
                                          "encoder.embeddings.", "encoder.position_bias.",
                                          "generator."], 30.0)
    assert scales["t5x3"] == dict.fromkeys(scales["t5"], 3.0)
    assert scales["tuned-x2"] == dict.fromkeys(scales["t5"], 2.0)


def test_a_tokenizer_left_in_a_directory_without_checkpoints_is_not_reused(tiny_tsv, tmp_path):
    """Only a resumed run keeps its tokenizer; a fresh run trains one with its --vocab-size."""
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(train_args(tiny_tsv, first, "--steps", "1", "--vocab-size", "80")) == 0
    second.mkdir()
    (second / "tokenizer.json").write_bytes((first / "tokenizer.json").read_bytes())
    assert main(train_args(tiny_tsv, second, "--steps", "1", "--vocab-size", "160")) == 0
    sizes = [json.loads((run / "run.json").read_text())["assets"]["vocab_size"]
             for run in (first, second)]
    assert sizes[0] <= 80 < sizes[1]
