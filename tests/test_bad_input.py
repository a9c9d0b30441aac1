"""The bad-input matrix: one row per bad input, across data files, configs, model calls, run
directories and the command line.

Each row names the input, the call (an ``aiayn`` command line or a Python API call), the expected
outcome (exit code, or exception type) and the words the message must contain (file, line, field
or value). After every row the test also checks that nothing was lost or half-written: a training
``--out`` directory that did not exist still does not exist, and every run directory the row
touched has exactly the bytes it had before the call (SHA-256 of every file).

Tiny runs of each task are trained once per module (a few optimizer steps on tiny data); a row that
damages a run works on its own copy.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from aiayn import CausalLM, SequenceClassifier, Transformer, TransformerConfig, TransformerEncoder
from aiayn.commands.train import non_negative_int, positive_int
from aiayn.cli import build_parser, main

TINY = TransformerConfig.preset("tiny")  # vocab 100, d_model 32, 4 heads, max_length 64

# Tiny training settings per task: seconds on one thread.
COMMON = ["--threads", "1", "--no-progress", "--steps", "2", "--save-every", "2",
          "--eval-every", "2", "--log-every", "1", "--warmup", "1"]
TASK_ARGS = {
    "translation": ["--preset", "tiny", "--set", "max_length=128", "--vocab-size", "80",
                    "--max-tokens", "400", "--valid-bleu-sentences", "0", "--best-metric", "loss",
                    "--best-mode", "min"],
    "lm": ["--preset", "baby-gpt", "--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64",
           "--set", "n_decoder_layers=1", "--block-size", "16", "--batch-size", "4"],
    "classification": ["--preset", "tiny", "--batch-size", "8", "--vocab-size", "80",
                       "--max-tokens", "16"],
    "mlm": ["--preset", "tiny", "--batch-size", "8", "--vocab-size", "80", "--max-tokens", "16"],
}
WORDS = {
    "net": "network socket http server client proxy download packet route",
    "sound": "audio music player mixer volume sample synth midi speaker",
    "games": "game player level puzzle arcade board score chess card",
}
LM_TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
           "\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 8
PAIRS = [("the cat sat on the mat", "die katze sass auf der matte"),
         ("a dog runs in the park", "ein hund rennt im park"),
         ("we read a good book", "wir lesen ein gutes buch"),
         ("the house is small", "das haus ist klein"),
         ("she drinks cold water", "sie trinkt kaltes wasser")] * 6


def write_data(directory: Path) -> dict[str, Path]:
    """Good tiny data for each task."""
    rng = random.Random(0)
    rows = [(" ".join(rng.choice(words.split()) for _ in range(rng.randint(3, 7))), label)
            for label, words in WORDS.items() for _ in range(20)]
    rng.shuffle(rows)
    paths = {"translation": directory / "pairs.tsv", "lm": directory / "text.txt",
             "classification": directory / "labelled.tsv", "mlm": directory / "texts.txt"}
    paths["translation"].write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS), encoding="utf-8")
    paths["lm"].write_text(LM_TEXT, encoding="utf-8")
    paths["classification"].write_text(
        "text\tlabel\n" + "".join(f"{t}\t{l}\n" for t, l in rows), encoding="utf-8")
    paths["mlm"].write_text("".join(f"{t}\n" for t, _ in rows), encoding="utf-8")
    return paths


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return write_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory, one_thread) -> dict[str, Path]:
    """One finished tiny run per task (2 steps, a checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("runs")
    made = {}
    for task, extra in TASK_ARGS.items():
        out = root / task
        assert main(["train", task, "--data", str(data[task]), "--out", str(out), *COMMON,
                     *extra]) == 0, task
        made[task] = out
    return made


def tree_digest(path: Path) -> dict[str, str]:
    """SHA-256 of every file under ``path`` (relative names), or {} when it does not exist."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


class Ctx:
    """What a row may use: good data, finished runs, and scratch paths it must leave as they are."""

    def __init__(self, tmp: Path, data: dict[str, Path], runs: dict[str, Path]):
        self.tmp, self.data, self.runs = tmp, data, runs
        self.watched: dict[Path, dict[str, str]] = {}  # path -> digest taken before the call
        self.absent: list[Path] = []  # must not exist after the call
        self.stdin: bytes | None = None  # what a command reads from stdin

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return self.watch(path)

    def dir(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir()
        return self.watch(path)

    def watch(self, path: Path) -> Path:
        self.watched[path] = tree_digest(path)
        return path

    def run(self, task: str, damage: Callable[[Path], Any] | None = None) -> Path:
        """A private copy of the tiny ``task`` run, damaged by ``damage(run_dir)``, then watched."""
        path = self.tmp / f"run-{task}-{len(self.watched)}"
        shutil.copytree(self.runs[task], path)
        if damage is not None:
            damage(path)
        return self.watch(path)

    def out(self, name: str = "out") -> Path:
        """A ``--out`` path that must still not exist after a failed call."""
        path = self.tmp / name
        self.absent.append(path)
        return path

    def check_nothing_lost(self) -> None:
        for path, before in self.watched.items():
            assert tree_digest(path) == before, f"{path} changed"
            assert not [p for p in path.parent.glob(f".{path.name}*")], "temporary file left"
        for path in self.absent:
            assert not path.exists(), f"{path} was created by a failed call"


@pytest.fixture
def ctx(tmp_path, data, runs) -> Ctx:
    return Ctx(tmp_path, data, runs)


@dataclass(frozen=True)
class Row:
    """``call(ctx)`` returns argv (kind "cli") or performs the API call (kind "api")."""

    kind: str
    call: Callable[[Ctx], Any]
    expect: int | type[BaseException]  # exit code for "cli", exception type for "api"
    words: tuple[str, ...] = ()


ROWS: list = []


def cli(id: str, call: Callable[[Ctx], list[str]], *words: str, code: int = 1) -> None:
    ROWS.append(pytest.param(Row("cli", call, code, words), id=id))


def api(id: str, call: Callable[[Ctx], Any], error: type[BaseException], *words: str) -> None:
    ROWS.append(pytest.param(Row("api", call, error, words), id=id))


def train(task: str, c: Ctx, *data: Path | str, extra: tuple[str, ...] = ()) -> list[str]:
    """argv training ``task`` on ``data`` into a fresh --out that must stay absent."""
    return ["train", task, "--data", *map(str, data), "--out", str(c.out()), *COMMON,
            *TASK_ARGS[task], *extra]


# --- data files: every task that reads files -------------------------------------------------------
BINARY = b"good line\tgut\n\xff\xfe\x00binary\tjunk\n"
GZIPPED = __import__("gzip").compress(b"text\tlabel\n" + b"some words\tnet\n" * 200)
# Every task reads through aiayn.data.text_files: one message format (path:line: / path:).
for task, missing in [("translation", "data file not found"), ("lm", "text file not found"),
                      ("classification", "data file not found"), ("mlm", "text file not found")]:
    cli(f"data-{task}-missing", lambda c, t=task: train(t, c, c.tmp / "nope.txt"),
        "nope.txt: ", missing)
    cli(f"data-{task}-empty", lambda c, t=task: train(t, c, c.file("empty.txt", "")),
        "empty.txt: the file is empty")
    cli(f"data-{task}-blank-lines-only",
        lambda c, t=task: train(t, c, c.file("blank.txt", "  \n\n \t\n")), "blank.txt")
    cli(f"data-{task}-directory", lambda c, t=task: train(t, c, c.dir("corpus")),
        "corpus: is a directory")
    cli(f"data-{task}-binary", lambda c, t=task: train(t, c, c.file("bad.bin", BINARY)),
        "bad.bin:2: not UTF-8 text (byte 0xff at column 1)")
    cli(f"data-{task}-gz-that-is-not-gzip",
        lambda c, t=task: train(t, c, c.file("plain.txt.gz", "plain text\tnot gzip\n")),
        "plain.txt.gz: not a valid gzip file", "Not a gzipped file")
    cli(f"data-{task}-truncated-gz",
        lambda c, t=task: train(t, c, c.file("cut.txt.gz", GZIPPED[:len(GZIPPED) // 2])),
        "cut.txt.gz: not a valid gzip file", "ended before the end-of-stream marker")

cli("data-translation-wrong-field-count",
    lambda c: train("translation", c, c.file("f.tsv", "a b\tc d\njust one field\n")),
    "f.tsv:2: expected at least 2 tab-separated fields", "just one field")
cli("data-translation-empty-source",
    lambda c: train("translation", c, c.file("s.tsv", "a b\tc d\n\tc d\n")),
    "s.tsv:2: empty source text")
cli("data-translation-empty-target",
    lambda c: train("translation", c, c.file("t.tsv", "a b\tc d\na b\t  \n")),
    "t.tsv:2: empty target text")
cli("data-translation-two-files-unaligned",
    lambda c: train("translation", c, c.file("src.txt", "a\nb\nc\n"), c.file("tgt.txt", "a\nb\n")),
    "src.txt: has 3 lines but", "tgt.txt has 2", "line-aligned")
cli("data-translation-two-files-binary-target",
    lambda c: train("translation", c, c.file("src.txt", "a\nb\n"), c.file("tgt.bin", b"a\n\xff\n")),
    "tgt.bin:2", "UTF-8")
cli("data-translation-three-files",
    lambda c: train("translation", c, c.file("a.txt", "a\n"), c.file("b.txt", "b\n"),
                    c.file("c.txt", "c\n")), "a source and a target file", "got 3 paths")
cli("data-translation-absurdly-long-line",
    lambda c: train("translation", c, c.file("long.tsv", "w " * 200_000 + "\tx y\n")),
    "long.tsv: no training pair is within max_length=128", "--max-length")
cli("data-classification-wrong-field-count",
    lambda c: train("classification", c, c.file("f.tsv", "text\tlabel\nfine\tnet\nno label\n")),
    "f.tsv:3: expected 2 tab-separated fields")
cli("data-classification-empty-label",
    lambda c: train("classification", c, c.file("l.tsv", "text\tlabel\nhello\t\nworld\tnet\n")),
    "l.tsv:2: empty label")
cli("data-classification-empty-text",
    lambda c: train("classification", c, c.file("e.tsv", "text\tlabel\n\tnet\nworld\tnet\n")),
    "e.tsv:2: empty text")
cli("data-classification-one-label-only",
    lambda c: train("classification", c, c.file("one.tsv", "".join(
        f"text number {i}\tnet\n" for i in range(30)))), "one.tsv", "at least 2 labels", "'net'")
cli("data-classification-too-few-rows-for-a-split",
    lambda c: train("classification", c, c.file("two.tsv", "text\tlabel\nhttp\tnet\nmidi\tsound\n")),
    "two.tsv: too few rows for a validation split")
cli("data-mlm-single-text",
    lambda c: train("mlm", c, c.file("one.txt", "just one text\n")), "one.txt", "at least 2 texts")
cli("data-mlm-tsv-wrong-field-count",
    lambda c: train("mlm", c, c.file("m.tsv", "text\tlabel\nhello\tx\nonly\n")),
    "m.tsv:3: expected 2 tab-separated fields")
cli("data-translation-split-column-without-train-rows",
    lambda c: train("translation", c, c.file("s.tsv", "en\tde\tsplit\na\tb\ttest\nc\td\ttest\n")),
    "s.tsv: no training pairs")
cli("data-mlm-tsv-without-text-column",
    lambda c: train("mlm", c, c.file("t.tsv", "body\tlabel\nhello\tx\n")),
    "t.tsv:1: a TSV corpus needs a header row naming a 'text' column")
cli("data-lm-text-shorter-than-a-block",
    lambda c: train("lm", c, c.file("short.txt", "tiny text\n")), "short.txt")
cli("data-classification-evaluate-unseen-label",
    lambda c: ["evaluate", str(c.run("classification")), "--data",
               str(c.file("u.tsv", "text\tlabel\nhttp server\tnet\nsome words\tcooking\n")),
               "--split", "all"], "u.tsv:3: unknown label 'cooking'")
cli("data-lm-evaluate-unseen-character",
    lambda c: ["evaluate", str(c.run("lm")), "--data", str(c.file("z.txt", "First Zebra\n"))],
    "z.txt", "'Z'")
cli("data-lm-evaluate-text-shorter-than-the-context",
    lambda c: ["evaluate", str(c.run("lm")), "--data", str(c.file("s.txt", "All the\n")),
               "--split", "valid"], "the valid part of", "s.txt text has",
    "shorter than the context")
cli("data-lm-generate-unseen-character",
    lambda c: ["generate", str(c.run("lm")), "--prompt", "Zebra", "--max-new-tokens", "2"],
    "'Z' is not in the model's vocabulary")
def stdin(c: Ctx, data: bytes, argv: list[str]) -> list[str]:
    c.stdin = data
    return argv


cli("data-translate-stdin-not-utf8",
    lambda c: stdin(c, b"the cat\n\xff\xfe sat\n", ["translate", str(c.run("translation"))]),
    "stdin:2: not UTF-8")
cli("data-classify-stdin-not-utf8",
    lambda c: stdin(c, b"http server\n\xff\n", ["classify", str(c.run("classification"))]),
    "stdin:2: not UTF-8")
cli("data-translate-beam-zero",
    lambda c: stdin(c, b"the cat\n", ["translate", str(c.run("translation")), "--beam", "0"]),
    "argument --beam: must be a positive integer, got '0'", code=2)
cli("data-evaluate-beam-zero",
    lambda c: ["evaluate", str(c.run("translation")), "--data", str(c.tmp / "any.tsv"), "--beam",
               "-1"], "argument --beam: must be a positive integer, got '-1'", code=2)
cli("data-classify-top-zero",
    lambda c: stdin(c, b"http server\n", ["classify", str(c.run("classification")), "--top", "0"]),
    "argument --top: must be a positive integer, got '0'", code=2)
cli("data-translation-evaluate-bad-file",
    lambda c: ["evaluate", str(c.run("translation")), "--data",
               str(c.file("f.tsv", "a b\tc d\nno tab\n"))], "f.tsv:2")
cli("data-mlm-evaluate-missing-file",
    lambda c: ["evaluate", str(c.run("mlm")), "--data", str(c.tmp / "gone.txt")], "gone.txt")
# Options a command would otherwise drop without a word
for task in ("lm", "mlm"):
    cli(f"option-{task}-evaluate-output",
        lambda c, t=task: ["evaluate", str(c.run(t)), "--data", str(c.file("t.txt", "All the\n")),
                           "--output", str(c.out("outputs.txt"))],
        "--output writes a translation", f"a '{task}' run's evaluation has only scores")
cli("option-lm-evaluate-two-files",
    lambda c: ["evaluate", str(c.run("lm")), "--data", str(c.file("a.txt", "All the\n")),
               str(c.file("b.txt", "the All\n"))], "one text file", "got 2 paths")
for task, option in (("lm", ["--beam", "4"]), ("mlm", ["--compile"]),
                     ("classification", ["--alpha", "1.0"]), ("lm", ["--max-tokens", "100"])):
    cli(f"option-{task}-evaluate-{option[0].lstrip('-')}",
        lambda c, t=task, o=option: ["evaluate", str(c.run(t)), "--data",
                                     str(c.file("t.txt", "All the\n")), *o],
        f"{option[0]} applies to translation", f"a '{task}' run's evaluation does not use it")
cli("option-generate-greedy-with-sampling",
    lambda c: ["generate", str(c.run("lm")), "--prompt", "All", "--greedy", "--top-k", "5",
               "--temperature", "0.7"],
    "--greedy always picks the likeliest token, so --temperature, --top-k would do nothing")


# --- configuration -----------------------------------------------------------------------------------
for name, overrides, words in [
        ("negative-d_model", dict(d_model=-32), ("d_model", "-32")),
        ("zero-vocab", dict(vocab_size=0), ("vocab_size", "positive")),
        ("negative-layers", dict(n_encoder_layers=-1), ("n_encoder_layers", "-1")),
        ("zero-max_length", dict(max_length=0), ("max_length",)),
        ("float-d_ff", dict(d_ff=64.5), ("d_ff", "64.5")),
        ("heads-not-dividing-width", dict(n_heads=5), ("d_model (32)", "n_heads (5)")),
        ("dropout-one", dict(dropout=1.0), ("dropout", "[0, 1)", "1.0")),
        ("dropout-negative", dict(attention_dropout=-0.1), ("attention_dropout", "-0.1")),
        ("unknown-kernel", dict(attention="flash9"), ("attention", "'flash9'")),
        ("unknown-activation", dict(activation="swishy"), ("activation", "'swishy'")),
        ("unknown-positions", dict(positions="rotary9"), ("positions", "'rotary9'")),
        ("pad-outside-vocab", dict(pad_id=100), ("pad_id", "100")),
        ("odd-width-sinusoids", dict(d_model=33, n_heads=1), ("even d_model", "33"))]:
    api(f"config-{name}", lambda c, o=overrides: TransformerConfig.preset("tiny", **o),
        ValueError, *words)
api("config-unknown-preset", lambda c: TransformerConfig.preset("gigantic"), ValueError,
    "unknown preset 'gigantic'")
api("config-unknown-key-from-dict",
    lambda c: TransformerConfig.from_dict({**TINY.to_dict(), "widht": 3}), ValueError, "widht")
api("config-json-unknown-key",
    lambda c: TransformerConfig.load(c.file("config.json", json.dumps(
        {**TINY.to_dict(), "n_layerz": 2}))), ValueError, "config.json", "n_layerz")
api("config-json-not-json", lambda c: TransformerConfig.load(c.file("config.json", "{oops")),
    ValueError, "config.json", "not a valid JSON config")
api("config-json-missing", lambda c: TransformerConfig.load(c.tmp / "none.json"),
    FileNotFoundError, "none.json")
cli("config-cli-unknown-task", lambda c: ["train", "poetry", "--out", str(c.out())],
    "invalid choice: 'poetry'", code=2)
cli("config-cli-unknown-preset",
    lambda c: train("lm", c, c.data["lm"], extra=("--preset", "gigantic")),
    "unknown preset 'gigantic'")
cli("config-cli-unknown-field",
    lambda c: train("lm", c, c.data["lm"], extra=("--set", "widht=3")),
    "unknown model config field 'widht'")
cli("config-cli-heads-not-dividing",
    lambda c: train("lm", c, c.data["lm"], extra=("--set", "n_heads=3")),
    "d_model (32)", "n_heads (3)")
cli("config-cli-dropout-out-of-range",
    lambda c: train("classification", c, c.data["classification"], extra=("--set", "dropout=1.5")),
    "dropout", "1.5")
cli("config-cli-unknown-kernel",
    lambda c: train("mlm", c, c.data["mlm"], extra=("--set", "attention=nope")),
    "attention", "'nope'")
cli("config-cli-negative-steps",
    lambda c: train("lm", c, c.data["lm"], extra=("--steps", "-5")),
    "argument --steps: must be a positive integer, got '-5'", code=2)
cli("config-cli-zero-accumulation",
    lambda c: train("translation", c, c.data["translation"], extra=("--accumulation", "0")),
    "argument --accumulation: must be a positive integer, got '0'", code=2)
cli("config-cli-negative-keep-last",
    lambda c: train("mlm", c, c.data["mlm"], extra=("--keep-last", "-1")),
    "argument --keep-last: must be a non-negative integer", code=2)
cli("config-cli-best-metric-the-task-does-not-report",
    lambda c: train("classification", c, c.data["classification"], extra=("--best-metric", "f1")),
    "best_metric 'f1' is not among the task's metrics ['accuracy', 'loss', 'macro_f1']")
cli("config-cli-negative-weight-decay",
    lambda c: train("lm", c, c.data["lm"], extra=("--weight-decay", "-0.1")),
    "weight_decay must be non-negative", "-0.1")


# --- model calls -------------------------------------------------------------------------------------
def ids(*shape: int) -> torch.Tensor:
    return torch.randint(3, 100, shape)


api("model-float-ids", lambda c: CausalLM(TINY)(ids(2, 5).float()), TypeError, "integer token ids")
api("model-3d-ids", lambda c: CausalLM(TINY)(ids(2, 3, 4)), ValueError, "(B, T)")
api("model-1d-ids", lambda c: TransformerEncoder(TINY)(ids(5)), ValueError, "(B, T)")
api("model-list-ids", lambda c: SequenceClassifier(TINY)([[1, 2]]), TypeError, "tensor")
api("model-empty-sequence", lambda c: CausalLM(TINY)(ids(2, 0)), ValueError, "empty")
api("model-batch-mismatch", lambda c: Transformer(TINY)(ids(2, 5), ids(3, 4)), ValueError,
    "batch sizes differ: 2 vs 3")
api("model-mask-wrong-shape",
    lambda c: Transformer(TINY)(ids(2, 5), ids(2, 4),
                                src_padding_mask=torch.ones(2, 6, dtype=torch.bool)),
    ValueError, "padding_mask must have shape (B=2, S=5)")
api("model-mask-not-boolean",
    lambda c: SequenceClassifier(TINY)(ids(2, 5), padding_mask=torch.ones(2, 5)), ValueError,
    "boolean")
api("model-past-position-table", lambda c: TransformerEncoder(TINY)(ids(1, 65)), ValueError,
    "65 positions exceeds the position table")
api("model-generate-token-id-outside-vocabulary",
    lambda c: __import__("aiayn.decoding.generation").decoding.generation.generate(
        CausalLM(TINY).eval(), [1, 100], max_new_tokens=2), ValueError, "token id 100",
    "outside the vocabulary")


def generate_past_cache(c: Ctx) -> Any:
    from aiayn.decoding.generation import generate

    return generate(CausalLM(TINY).eval(), [1, 2, 3], max_new_tokens=63)


api("model-generate-past-cache", generate_past_cache, ValueError,
    "past the cache capacity", "65 positions", "holds 64")
cli("model-cli-generate-past-cache",
    lambda c: ["generate", str(c.run("lm")), "--prompt", "All", "--max-new-tokens", "30",
               "--no-slide"], "past the cache capacity")

api("model-generate-bool-token-ids", lambda c: _generate(CausalLM(TINY).eval(), [True, True]),
    ValueError, "prompt 0 holds True (bool), not an integer token id")
api("model-generate-stop-id-outside-vocabulary",
    lambda c: _generate(CausalLM(TINY).eval(), [1, 2], stop_ids=(1000,)), ValueError,
    "stop_ids 1000 is outside the vocabulary")
api("model-generate-pad-id-outside-vocabulary",
    lambda c: _generate(CausalLM(TINY).eval(), [[1, 2], [3]], pad_id=1000), ValueError,
    "pad_id 1000 is outside the vocabulary")
api("model-generate-nan-temperature",
    lambda c: _generate(CausalLM(TINY).eval(), [1, 2], temperature=float("nan")), ValueError,
    "temperature must be >= 0", "nan")
api("model-generate-encoder-decoder", lambda c: _generate(Transformer(TINY).eval(), [1, 2]),
    TypeError, "decoder-only model", "beam_search")
api("model-beam-nan-alpha", lambda c: _search("beam", alpha=float("nan")), ValueError,
    "alpha must be a non-negative number", "nan")
api("model-beam-negative-max-extra", lambda c: _search("beam", max_extra=-5), ValueError,
    "max_extra must be a non-negative integer, got -5")
api("model-greedy-1d-source", lambda c: _search("greedy", source=ids(5)), ValueError,
    "source_mask must be a (B, S) tensor, got (5,)")

api("model-cache-of-another-batch",
    lambda c: CausalLM(TINY)(ids(2, 1), cache=CausalLM(TINY).new_cache(1, 4)), ValueError,
    "the ids have 2 rows but the cache holds 1")

def _generate(model: Any, prompt: Any, **options: Any) -> Any:
    from aiayn.decoding.generation import generate

    return generate(model, prompt, max_new_tokens=2, **options)


def _search(kind: str, source: torch.Tensor | None = None, **options: Any) -> Any:
    from aiayn.decoding.beam import beam_search
    from aiayn.decoding.greedy import greedy_search

    source = ids(2, 5) if source is None else source
    search = beam_search if kind == "beam" else greedy_search
    return search(Transformer(TINY).eval(), source, source != 0, **options)


# --- run directories and checkpoints -----------------------------------------------------------------
def load(path: Path, **kwargs: Any) -> Any:
    from aiayn.training.run import load_run

    return load_run(path, **kwargs)


def truncate(name: str) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / name
        path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    return damage


def edit_run_json(**changes: Any) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        info = json.loads((run_dir / "run.json").read_text())
        for key, value in changes.items():
            if key == "model_config":
                info["model_config"].update(value)
            else:
                info[key] = value
        (run_dir / "run.json").write_text(json.dumps(info))
    return damage


def _hf_dir(c: Ctx, config: dict | str) -> Path:
    directory = c.tmp / "hf-dir"
    directory.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "config.json").write_text(text, encoding="utf-8")
    return c.watch(directory)


def other_run_weights(run_dir: Path) -> None:
    """Weights of another model, with a matching checksum: shapes must catch it."""
    from aiayn.training.checkpoint import save_weights

    config = TransformerConfig.from_dict(json.loads((run_dir / "run.json").read_text())
                                         ["model_config"]).replace(d_model=16, d_ff=32)
    digest = save_weights(CausalLM(config), run_dir / "model.safetensors")
    edit_run_json(weights_sha256=digest)(run_dir)


def flip_byte(run_dir: Path) -> None:
    data = bytearray((run_dir / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (run_dir / "model.safetensors").write_bytes(bytes(data))


api("run-missing", lambda c: load(c.tmp / "gone"), FileNotFoundError, "run directory not found")
api("run-a-file", lambda c: load(c.file("model.safetensors", b"x")), NotADirectoryError,
    "not a directory")
api("run-not-a-run", lambda c: load(c.dir("empty")), ValueError, "not an aiayn run directory",
    "run.json")
api("run-of-another-task", lambda c: load(c.run("lm"), task="translation"), ValueError,
    "a run of task 'lm', not 'translation'")
api("run-truncated-weights", lambda c: load(c.run("lm", truncate("model.safetensors"))),
    ValueError, "model.safetensors", "checksum mismatch")
api("run-flipped-byte-in-weights", lambda c: load(c.run("mlm", flip_byte)), ValueError,
    "model.safetensors", "checksum mismatch")
api("run-truncated-weights-no-checksum",
    lambda c: load(c.run("lm", lambda p: (truncate("model.safetensors")(p),
                                           edit_run_json(weights_sha256=None)(p)))),
    ValueError, "model.safetensors", "corrupt or truncated")
api("run-config-does-not-match-weights",
    lambda c: load(c.run("lm", edit_run_json(model_config={"d_ff": 96}))), ValueError,
    "weights do not match the model config", "shape mismatch")
api("run-weights-of-another-model", lambda c: load(c.run("lm", other_run_weights)), ValueError,
    "weights do not match the model config")
api("run-newer-format-version", lambda c: load(c.run("lm", edit_run_json(format_version=99))),
    ValueError, "run format version 99 is newer")
api("run-corrupt-run-json", lambda c: load(c.run("lm", lambda p: (p / "run.json").write_text(
    "{half"))), ValueError, "run.json", "corrupt run file")
api("run-json-missing-fields",
    lambda c: load(c.run("lm", lambda p: (p / "run.json").write_text('{"task": "lm"}'))),
    ValueError, "run.json", "needs task, format_version, model_config")
api("run-json-bad-model-config",
    lambda c: load(c.run("lm", edit_run_json(model_config={"n_heads": 7}))), ValueError,
    "run.json", "bad model_config", "n_heads")
api("run-json-foreign-model-class",
    lambda c: load(c.run("lm", edit_run_json(model_class="os:system"))), ValueError,
    "'os:system' is not an aiayn class")
api("run-no-weights-at-all",
    lambda c: load(c.run("lm", lambda p: ((p / "model.safetensors").unlink(),
                                          shutil.rmtree(p / "checkpoints")))),
    ValueError, "the run has no weights yet")
api("run-checkpoint-truncated-trainer-state",
    lambda c: load(c.run("lm", lambda p: ((p / "model.safetensors").unlink(), truncate(
        "checkpoints/step-2/trainer_state.safetensors")(p)))),
    ValueError, "trainer_state.safetensors", "checksum mismatch")
api("run-checkpoint-without-state",
    lambda c: load(c.run("lm", lambda p: ((p / "model.safetensors").unlink(),
                                          (p / "checkpoints/step-2/trainer_state.json").unlink()))),
    ValueError, "step-2: not a checkpoint")
api("run-weights-option-missing-file",
    lambda c: load(c.run("lm"), weights=c.tmp / "other.safetensors"), FileNotFoundError,
    "other.safetensors")
def from_pretrained(path: Path) -> Any:
    import aiayn

    return aiayn.from_pretrained(path)


api("hf-dir-missing", lambda c: from_pretrained(c.tmp / "gone"), FileNotFoundError,
    "checkpoint directory not found", "gone")
api("hf-dir-is-a-file", lambda c: from_pretrained(c.file("model.safetensors", b"x")),
    NotADirectoryError, "model.safetensors is a file")
api("hf-dir-without-config", lambda c: from_pretrained(c.dir("hf")), FileNotFoundError,
    "config.json: missing")
api("hf-unsupported-model-type",
    lambda c: from_pretrained(_hf_dir(c, {"model_type": "gpt_neox"})),
    ValueError, "model_type='gpt_neox' is not supported")
api("hf-config-not-json", lambda c: from_pretrained(_hf_dir(c, "{nope")), ValueError,
    "config.json", "not valid JSON")
cli("run-cli-attention-not-a-run",
    lambda c: ["attention", str(c.dir("empty")), "--text", "hi", "--out", str(c.out("maps"))],
    "is not an aiayn run directory")
cli("run-cli-plot-run-without-log",
    lambda c: ["plot", "run", str(c.dir("empty")), "--out", str(c.out("curves.png"))],
    "no training log", "log.jsonl")
cli("run-cli-translate-not-a-run", lambda c: ["translate", str(c.dir("notrun"))],
    "is not an aiayn run directory")
cli("run-cli-generate-a-translation-run",
    lambda c: ["generate", str(c.run("translation")), "--prompt", "x"],
    "a run of task 'translation', not 'lm'")
cli("run-cli-classify-truncated", lambda c: ["classify", str(c.run(
    "classification", truncate("model.safetensors"))), "--text", "x"], "checksum mismatch")
cli("run-cli-evaluate-newer-format",
    lambda c: ["evaluate", str(c.run("mlm", edit_run_json(format_version=2))), "--data",
               str(c.data["mlm"])], "newer than this aiayn reads")
cli("run-cli-train-into-a-run-of-another-task",
    lambda c: ["train", "lm", "--data", str(c.data["lm"]), "--out", str(c.run("mlm")), *COMMON,
               *TASK_ARGS["lm"]], "mlm")
cli("run-cli-resume-truncated-checkpoint",
    lambda c: ["train", "lm", "--data", str(c.data["lm"]), "--out",
               str(c.run("lm", truncate("checkpoints/step-2/model.safetensors"))), *COMMON,
               *TASK_ARGS["lm"], "--steps", "4"], "step-2", "model.safetensors")
def edit_checkpoint_state(**changes: Any) -> Callable[[Path], None]:
    def damage(run_dir: Path) -> None:
        path = run_dir / "checkpoints" / "step-2" / "trainer_state.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return damage


def resume_lm(c: Ctx, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "lm", "--data", str(c.data["lm"]), "--out", str(run_dir), *COMMON,
            *TASK_ARGS["lm"], "--steps", "4", *extra]


cli("run-cli-resume-checkpoint-of-a-newer-format",
    lambda c: resume_lm(c, c.run("lm", edit_checkpoint_state(format_version=99))),
    "trainer_state.json", "99", "newer")
cli("run-cli-resume-corrupt-checkpoint-state",
    lambda c: resume_lm(c, c.run("lm", lambda p: (
        p / "checkpoints/step-2/trainer_state.json").write_text("{"))),
    "trainer_state.json", "corrupt checkpoint state")
cli("run-cli-resume-with-another-model-config",
    lambda c: resume_lm(c, c.run("lm"), "--set", "d_model=64"),
    "holds a run with another model config", "d_model")
cli("run-cli-resume-with-other-training-settings",
    lambda c: resume_lm(c, c.run("lm"), "--seed", "3"),
    "trained with other settings", "seed (the run's 0, now 3)", "--init", "(options: --seed)")
cli("run-cli-resume-lm-on-text-with-other-characters",  # same count: the config still matches
    lambda c: ["train", "lm", "--data", str(c.file("other.txt", LM_TEXT.replace("a", "~"))),
               "--out", str(c.run("lm")), *COMMON, *TASK_ARGS["lm"], "--steps", "4"],
    "vocabulary.json differs", "another vocabulary.json", "another directory")
cli("run-cli-resume-classification-with-a-renamed-label",
    lambda c: ["train", "classification", "--data", str(c.file(
        "renamed.tsv", c.data["classification"].read_text(encoding="utf-8").replace(
            "\tnet\n", "\tzz_net\n"))), "--out", str(c.run("classification")), *COMMON,
        *TASK_ARGS["classification"], "--steps", "4"],
    "labels.json differs", "other data, labels or prefixes")
cli("run-cli-resume-with-fewer-steps-than-done",
    lambda c: resume_lm(c, c.run("lm"))[:-2] + ["--steps", "1"],
    "is at step 2, past steps=1 (--steps)", "give more steps")
cli("run-cli-train-out-is-a-file",
    lambda c: ["train", "translation", "--data", str(c.data["translation"]), "--out",
               str(c.file("out.txt", "my notes\n")), *COMMON, *TASK_ARGS["translation"]],
    "--out", "out.txt is a file, not a run directory")
cli("run-cli-init-from-a-translation-run",
    lambda c: train("classification", c, c.data["classification"],
                    extra=("--init", str(c.run("translation")))),
    "a run of task 'translation'")


# --- the command line: explicit rows, then one pair per sub-command generated from the parser ------
def usage(command: str) -> str:
    return f"usage: aiayn {command}"


cli("cli-unknown-command", lambda c: ["frobnicate"], "invalid choice: 'frobnicate'", code=2)
cli("cli-train-without-task", lambda c: ["train"], usage("train"), "choose a TASK", "lm", code=2)
cli("cli-no-command", lambda c: [], "aiayn: error: choose a COMMAND", code=2)
cli("cli-train-lm-without-out", lambda c: ["train", "lm", "--data", "x"], usage("train lm"),
    "--out", code=2)
cli("cli-train-translation-steps-not-a-number",
    lambda c: ["train", "translation", "--data", "x", "--out", str(c.out()), "--steps", "many"],
    "argument --steps: must be a positive integer, got 'many'", code=2)
cli("cli-train-mlm-bad-optimizer",
    lambda c: ["train", "mlm", "--data", "x", "--out", str(c.out()), "--optimizer", "sgd9"],
    "invalid choice: 'sgd9'", code=2)
cli("cli-generate-top-p-not-a-number",
    lambda c: ["generate", "r", "--top-p", "lots"], "invalid float value: 'lots'", code=2)
cli("cli-evaluate-without-data", lambda c: ["evaluate", "r"], usage("evaluate"), "--data", code=2)
cli("cli-train-unknown-device",
    lambda c: ["train", "lm", "--data", "x", "--out", str(c.out()), "--device", "foo"],
    "argument --device: unknown device 'foo'", code=2)
cli("cli-translate-device-this-torch-cannot-use",  # no CUDA here, or fewer than 100 GPUs
    lambda c: ["translate", "r", "--device", "cuda:99"], "argument --device: device 'cuda:99'",
    code=2)


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every sub-command that runs something."""
    subactions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subactions:
        yield path, parser
        return
    for name, sub in subactions[0].choices.items():
        yield from leaf_parsers(sub, (*path, name))


def required_args(parser: argparse.ArgumentParser) -> list[str]:
    """Placeholder values for every required argument (positionals and required options)."""
    argv: list[str] = []
    for action in parser._actions:
        if not action.option_strings and action.dest != "help":
            argv.append("x")
        elif action.required:
            argv += [action.option_strings[0], "x"]
    for group in parser._mutually_exclusive_groups:
        if group.required:
            argv += [group._group_actions[0].option_strings[0], "x"]
    return argv


def nonsense(parser: argparse.ArgumentParser) -> tuple[list[str], str]:
    """A value the parser must refuse: a word for a number, else a word outside the choices."""
    for action in parser._actions:
        if action.option_strings and action.type in (int, float):
            return [action.option_strings[0], "zillion"], f"invalid {action.type.__name__} value"
        if action.option_strings and action.type in (positive_int, non_negative_int):
            return [action.option_strings[0], "zillion"], "integer, got 'zillion'"
    for action in parser._actions:
        if action.option_strings and action.choices:
            return [action.option_strings[0], "zillion"], "invalid choice: 'zillion'"
    return ["--no-such-option"], "unrecognized arguments: --no-such-option"


for words, leaf in leaf_parsers(build_parser()):
    command = " ".join(words)
    needed = required_args(leaf)
    if needed:  # a sub-command with required arguments, given none
        cli(f"cli-parser-{'-'.join(words)}-missing-required",
            lambda c, w=words: list(w), usage(command), "required", code=2)
    bad, message = nonsense(leaf)
    cli(f"cli-parser-{'-'.join(words)}-nonsense-value",
        lambda c, w=words, n=needed, b=bad: [*w, *n, *b], usage(command), message, code=2)


# --- the test ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", ROWS)
def test_bad_input(row: Row, ctx: Ctx, capsys, monkeypatch) -> None:
    if row.kind == "cli":
        argv = row.call(ctx)
        if ctx.stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(ctx.stdin), "utf-8"))
        capsys.readouterr()
        try:
            code = main(argv)
        except SystemExit as exit_info:  # argparse errors
            code = exit_info.code
        err = capsys.readouterr().err
        assert code == row.expect, err
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines, "no message on stderr"
        if code == 1:
            assert "error:" in lines[-1], err
        for word in row.words:
            assert word in err, f"{word!r} not in {err!r}"
    else:
        with pytest.raises(row.expect) as info:
            row.call(ctx)
        for word in row.words:
            assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
    ctx.check_nothing_lost()


def test_the_matrix_is_large_and_covers_every_category():
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids)), "duplicate row ids"
    counts = {prefix: sum(i.startswith(prefix + "-") for i in ids)
              for prefix in ("data", "config", "model", "run", "hf", "cli")}
    assert all(count >= 5 for count in counts.values()), counts
    assert len(ids) >= 45
    trained = {i.removeprefix("cli-parser-train-").rsplit("-", 2)[0]  # task names may hold "-"
               for i in ids if i.startswith("cli-parser-train-")}
    from aiayn.commands.train import available_tasks

    assert trained == set(available_tasks())  # every `train TASK` has generated rows


# --- absurdly long lines at inference, and nothing lost before a bad line ---------------------------
@pytest.mark.parametrize("command", ["translate", "classify"])
def test_long_lines_are_answered_and_lines_before_a_bad_one_are_kept(command, runs, capsys,
                                                                     monkeypatch):
    """A line far past the position table is still answered (cut to the model's length); the
    lines before a non-UTF-8 line are answered, in order, before the error."""
    run_dir = runs["translation" if command == "translate" else "classification"]
    before = tree_digest(run_dir)
    long_line = "the cat sat on the mat " * 2000  # ~14000 tokens; max_length is 128 / 64
    data = f"the house is small\n{long_line}\n".encode() + b"\xff broken\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), "utf-8"))
    capsys.readouterr()
    assert main([command, str(run_dir)]) == 1
    captured = capsys.readouterr()
    assert "stdin:3: not UTF-8" in captured.err and "Traceback" not in captured.err
    assert len(captured.out.splitlines()) == 2  # lines 1 and 2 answered
    assert tree_digest(run_dir) == before
