"""Loading never unpickles: a malicious pickle put where a user might put weights is refused.

The payloads below would create a marker file the moment they are unpickled (``os.system`` or
``open`` in ``__reduce__``; the first test proves they are live). Each row places one where a user
might: a ``pytorch_model.bin`` in a Hugging Face directory given to ``from_pretrained`` / ``--init``
/ ``aiayn attention``, a pickle renamed ``model.safetensors`` in a run or a checkpoint, a ``*.pt``
given as ``weights=``, a pickle in place of a JSON file. Every loading entry point must refuse it
with a clear error naming the file, and the marker must never appear. A static check scans src/
for ``torch.load`` without ``weights_only=True`` and for any pickle-based module.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import aiayn
from aiayn import TransformerConfig, TransformerEncoder
from aiayn.cli import main

SRC = Path(__file__).resolve().parents[1] / "src" / "aiayn"
BERT_LIKE = TransformerConfig.preset(
    "tiny", positions="learned", norm_first=False, final_norm=False, scale_embeddings=False,
    embedding_norm=True, type_vocab_size=2, n_encoder_layers=1, activation="gelu")
LM_TRAIN = ["--preset", "baby-gpt", "--set", "d_model=32", "--set", "n_heads=2", "--set",
            "d_ff=64", "--set", "n_decoder_layers=1", "--block-size", "16", "--batch-size", "4",
            "--threads", "1", "--no-progress", "--steps", "2", "--save-every", "2",
            "--eval-every", "0", "--warmup", "1"]
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 30


class RunsShell:
    """Unpickling calls os.system("touch MARKER")."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


class OpensFile:
    """Unpickling calls open(MARKER, "w"): creates the file without any shell."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


def payload(kind: str, marker: Path) -> bytes:
    """Bytes that create ``marker`` when unpickled: a bare pickle or a torch.save zip file."""
    if kind == "pickle-os.system":
        return pickle.dumps({"weight": RunsShell(marker)}, protocol=2)
    if kind == "pickle-open":
        return pickle.dumps({"weight": OpensFile(marker)})
    buffer = io.BytesIO()
    torch.save({"weight": RunsShell(marker), "bias": torch.zeros(2)}, buffer)
    return buffer.getvalue()


PAYLOADS = ("pickle-os.system", "pickle-open", "torch.save-os.system")
# torch's weights-only unpickler warns about the protocol-4 payload before refusing it.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


@pytest.mark.parametrize("kind", PAYLOADS)
def test_the_payloads_are_live(kind, tmp_path):
    """Without the safeguards each payload does create its marker (so the rows below mean it)."""
    marker = tmp_path / "pwned"
    data = payload(kind, marker)
    if kind.startswith("torch.save"):
        torch.load(io.BytesIO(data), weights_only=False)
    else:
        pickle.loads(data)
    assert marker.exists()


# --- where a user might put one ------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, one_thread) -> Path:
    root = tmp_path_factory.mktemp("safe")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    assert main(["train", "lm", "--data", str(root / "text.txt"), "--out", str(root / "run"),
                 *LM_TRAIN]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A Hugging Face BERT directory (config.json + vocab.txt) with no weights yet."""
    directory = tmp_path_factory.mktemp("hf") / "bert"
    aiayn.save_pretrained(TransformerEncoder(BERT_LIKE), directory)
    (directory / "model.safetensors").unlink()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(95)]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return directory


class Place:
    def __init__(self, tmp: Path, lm_run: Path, hf_dir: Path, evil: bytes):
        self.tmp, self._lm_run, self._hf_dir, self.evil = tmp, lm_run, hf_dir, evil

    def hf(self, name: str = "pytorch_model.bin") -> Path:
        directory = self.tmp / "hf"
        shutil.copytree(self._hf_dir, directory)
        (directory / name).write_bytes(self.evil)
        return directory

    def run(self, name: str, *, keep_checksum: bool = True, drop: tuple[str, ...] = ()) -> Path:
        directory = self.tmp / "run"
        shutil.copytree(self._lm_run, directory)
        for gone in drop:
            path = directory / gone
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        (directory / name).write_bytes(self.evil)
        if not keep_checksum:  # reach the reader itself, not only the checksum guard
            info = json.loads((directory / "run.json").read_text())
            info.pop("weights_sha256", None)
            (directory / "run.json").write_text(json.dumps(info))
        return directory

    def file(self, name: str) -> Path:
        path = self.tmp / name
        path.write_bytes(self.evil)
        return path


def load_run(path: Path, **kwargs: Any):
    from aiayn.training.run import load_run as load

    return load(path, **kwargs)


def read_tensors(path: Path):
    from aiayn.training.weights import read_tensors as read

    return read(path)


def load_weights(path: Path):
    from aiayn.training.weights import load_weights as load

    return load(TransformerEncoder(BERT_LIKE), path)


def cli(*argv: str) -> None:
    """A CLI call that must fail with exit code 1 (the error message is on stderr)."""
    code = main(list(argv))
    assert code == 1, code


# (row id, call(place) -> None or raises, expected error type or None for "CLI exit 1",
#  words of the message)
ENTRY_POINTS: list = [
    ("hf-pytorch_model.bin-from_pretrained", lambda p: aiayn.from_pretrained(p.hf()), ValueError,
     ("pytorch_model.bin", "weights-only", "never unpickles")),
    ("hf-pytorch_model.bin-from_pretrained-encoder-task",
     lambda p: aiayn.from_pretrained(p.hf(), task="encoder"), ValueError, ("pytorch_model.bin",)),
    ("hf-pickle-renamed-model.safetensors-from_pretrained",
     lambda p: aiayn.from_pretrained(p.hf("model.safetensors")), ValueError,
     ("model.safetensors", "not a readable safetensors file", "never loads")),
    ("hf-pytorch_model.bin-train-classification-init",
     lambda p: cli("train", "classification", "--data", str(p.tmp / "x.tsv"), "--out",
                   str(p.tmp / "out"), "--init", str(p.hf()), "--steps", "1"), None,
     ("pytorch_model.bin",)),
    ("hf-pytorch_model.bin-attention-command",
     lambda p: cli("attention", str(p.hf()), "--text", "w1 w2", "--out", str(p.tmp / "maps")),
     None, ("pytorch_model.bin",)),
    ("run-pickle-as-model.safetensors-load_run",
     lambda p: load_run(p.run("model.safetensors")), ValueError, ("checksum mismatch",)),
    ("run-pickle-as-model.safetensors-no-checksum-load_run",
     lambda p: load_run(p.run("model.safetensors", keep_checksum=False)), ValueError,
     ("model.safetensors", "not a readable safetensors file")),
    ("run-pickle-as-checkpoint-weights-load_run",
     lambda p: load_run(p.run("checkpoints/step-2/model.safetensors", drop=("model.safetensors",))),
     ValueError, ("step-2", "model.safetensors")),
    ("run-pickle-as-trainer-state-load_run",
     lambda p: load_run(p.run("checkpoints/step-2/trainer_state.safetensors",
                              drop=("model.safetensors",))),
     ValueError, ("trainer_state.safetensors",)),
    ("run-pickle-as-run.json", lambda p: load_run(p.run("run.json")), ValueError,
     ("run.json", "corrupt run file")),
    ("run-pickle-as-vocabulary", lambda p: load_run(p.run("vocabulary.json")), ValueError,
     ("vocabulary.json",)),
    ("run-weights-option-model.pt", lambda p: load_run(p.run("x"), weights=p.file("model.pt")),
     ValueError, ("model.pt", "not a readable safetensors file", "pickle / torch.save")),
    ("read_tensors-model.bin", lambda p: read_tensors(p.file("model.bin")), ValueError,
     ("model.bin", "not a readable safetensors file")),
    ("load_weights-pytorch_model.bin", lambda p: load_weights(p.file("pytorch_model.bin")),
     ValueError, ("pytorch_model.bin",)),
    ("config-load-pickle", lambda p: TransformerConfig.load(p.file("config.json")), ValueError,
     ("config.json", "not a valid JSON config")),
    ("cli-generate-pickled-run",
     lambda p: cli("generate", str(p.run("model.safetensors", keep_checksum=False)), "--prompt",
                   "First", "--max-new-tokens", "2"), None, ("not a readable safetensors file",)),
    ("cli-evaluate-pickled-run",
     lambda p: cli("evaluate", str(p.run("model.safetensors")), "--data", str(p.file("t.txt"))),
     None, ("checksum mismatch",)),
    ("cli-resume-from-pickled-checkpoint",
     lambda p: cli("train", "lm", "--data", str(p.tmp / "text.txt"), "--out",
                   str(p.run("checkpoints/step-2/model.safetensors")), *LM_TRAIN, "--steps", "4"),
     None, ("step-2", "model.safetensors")),
]


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("row_id, call, error, words", ENTRY_POINTS,
                         ids=[row[0] for row in ENTRY_POINTS])
def test_a_malicious_pickle_is_refused_and_never_run(row_id, call, error, words, kind, lm_run,
                                                     hf_dir, tmp_path, capsys):
    marker = tmp_path / "pwned"
    place = Place(tmp_path, lm_run, hf_dir, payload(kind, marker))
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "x.tsv").write_text("".join(f"a b {i}\tnet\nc d {i}\tsound\n" for i in range(10)),
                                    encoding="utf-8")  # distinct texts: a held-out split exists
    capsys.readouterr()
    if error is None:
        call(place)
        message = capsys.readouterr().err
        assert "Traceback" not in message
    else:
        with pytest.raises(error) as info:
            call(place)
        message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert not marker.exists(), "the pickle was executed"


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.bin", "training_args.bin"])
def test_stray_pickles_next_to_a_run_are_ignored(name, lm_run, tmp_path):
    """A run loads from its safetensors; a pickle lying beside it is never opened."""
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    shutil.copytree(lm_run, run_dir)
    (run_dir / name).write_bytes(payload("pickle-os.system", marker))
    (run_dir / "checkpoints" / "step-2" / name).write_bytes(payload("torch.save-os.system", marker))
    run = load_run(run_dir)
    assert run.weights == run_dir / "model.safetensors"
    assert not marker.exists()


# --- static check: no unpickling anywhere in the package -------------------------------------------
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve",
                  "marshal"}


def unsafe_loading_calls(source: str, filename: str) -> list[str]:
    """``torch.load`` without ``weights_only=True``, pickle-module use, ``allow_pickle=True``."""
    problems = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            problems += [f"{where}: import {a.name}" for a in node.names
                         if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in PICKLE_MODULES:
                problems.append(f"{where}: from {node.module} import ...")
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                problems.append(f"{where}: from torch import load (use torch.load(weights_only=True))")
        elif isinstance(node, ast.Name) and node.id in PICKLE_MODULES:
            problems.append(f"{where}: uses {node.id}")
        elif isinstance(node, ast.Call):
            func = node.func
            keywords = {k.arg: k.value for k in node.keywords}
            if isinstance(func, ast.Attribute) and func.attr == "load" and \
                    isinstance(func.value, ast.Name) and func.value.id == "torch":
                safe = keywords.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    problems.append(f"{where}: torch.load without weights_only=True")
            allow = keywords.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                problems.append(f"{where}: allow_pickle")
    return problems


def test_the_static_check_catches_what_it_looks_for():
    bad = ("import pickle\nimport torch\nimport numpy as np\nfrom torch import load\n"
           "torch.load(p)\ntorch.load(p, weights_only=False)\nnp.load(p, allow_pickle=True)\n"
           "import dill.settings\n")
    assert len(unsafe_loading_calls(bad, "bad.py")) == 6
    good = "import torch\ntorch.load(p, map_location='cpu', weights_only=True)\n# pickle\n"
    assert unsafe_loading_calls(good, "good.py") == []


def test_the_package_never_unpickles():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50
    problems = [problem for path in files
                for problem in unsafe_loading_calls(path.read_text(encoding="utf-8"), str(path))]
    assert problems == []
    loads = [path for path in files if "torch.load(" in path.read_text(encoding="utf-8")]
    assert loads, "expected the legacy pytorch_model.bin reader to be found and checked"
