"""The commands as Unix filters: a reader that goes away (`| head`), a batch stopped part way,
stdin of a terminal, the chat's stdin, and `--output` paths that are not plain files."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aiayn.cli import main

WORDS = ["http server", "image viewer", "text editor", "mail client", "sound mixer"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    """A tiny classification run (a few steps: these tests need a run, not a good one)."""
    root = tmp_path_factory.mktemp("classifier")
    data = root / "labels.tsv"
    rows = ["text\tlabel"] + [f"{WORDS[i % 5]} number {i}\t{'net' if i % 5 < 2 else 'desk'}"
                              for i in range(80)]
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert main(["train", "classification", "--data", str(data), "--out", str(root / "run"),
                 "--preset", "tiny", "--steps", "2", "--vocab-size", "120", "--no-progress",
                 "--threads", "1"]) == 0
    return root / "run"


def stdin_of(monkeypatch, data: bytes, *, tty: bool = False) -> None:
    stream = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    stream.isatty = lambda: tty
    monkeypatch.setattr(sys, "stdin", stream)


class GoneAfter(io.StringIO):
    """A stdout whose reader leaves after ``lines`` lines: later writes raise BrokenPipeError."""

    def __init__(self, lines: int):
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= text.count("\n")
        return super().write(text)


def test_a_reader_that_goes_away_stops_the_filter_quietly(classifier, tmp_path):
    """`aiayn classify RUN < many | head -n 1`: exit status 141 (a filter its pipe stopped), no
    message, and the rest of the input is not read through."""
    lines = tmp_path / "many.txt"
    lines.write_text("".join(f"{WORDS[i % 5]} {i}\n" for i in range(3000)), encoding="utf-8")
    script = (f"{sys.executable} -m aiayn classify {classifier} --threads 1 --batch-size 8 "
              f"< {lines} | head -n 1; echo status ${{PIPESTATUS[0]}} >&2")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert len(result.stdout.splitlines()) == 1
    assert result.stderr.strip().splitlines() == ["status 141"]


@pytest.mark.parametrize("command", ["classify", "translate"])
def test_each_batch_is_answered_once_whatever_stops_it(command, monkeypatch, classifier):
    """A batch whose answer stops part way (the reader left, Ctrl-C) is not answered a second
    time on the way out; a line that is not UTF-8 still has the lines before it answered."""
    from aiayn.commands import classify, translate

    batches = []

    def answer(texts, *rest):
        batches.append(list(texts))
        for text in texts:
            sys.stdout.write(f"{text}\n")

    if command == "classify":
        monkeypatch.setattr(classify, "_classifier_answers", lambda args: answer)
        argv = ["classify", str(classifier), "--batch-size", "4"]
    else:
        monkeypatch.setattr(translate, "_flush", lambda inference, tokenizer, prefix, lines, args:
                            answer(lines))
        monkeypatch.setattr(translate.engine, "engine", lambda model, args: None)
        monkeypatch.setattr("aiayn.tasks.checkpoints.load_model_dir", lambda *a, **k: Loaded())
        monkeypatch.setattr("aiayn.tasks.checkpoints.directory_task", lambda path: "translation")
        monkeypatch.setattr("aiayn.tasks.checkpoints.set_languages", lambda *a: None)
        argv = ["translate", "RUN", "--batch-lines", "4"]
    stdin_of(monkeypatch, "".join(f"line {i}\n" for i in range(10)).encode())
    monkeypatch.setattr(sys, "stdout", GoneAfter(6))
    with pytest.raises(BrokenPipeError):
        (classify if command == "classify" else translate).run(build(argv))
    assert [len(batch) for batch in batches] == [4, 4]  # the second stopped: not answered again

    batches.clear()
    stdin_of(monkeypatch, b"a\nb\nc\n\xff\n")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    with pytest.raises(ValueError, match="stdin:4: not UTF-8"):
        (classify if command == "classify" else translate).run(build(argv))
    assert batches == [["a", "b", "c"]]


class Loaded:
    class model:  # noqa: N801 - stands in for a loaded run's model
        @staticmethod
        def to(device):
            return None

    assets = None


def build(argv: list[str]):
    from aiayn.cli import build_parser

    return build_parser().parse_args(argv)


def test_translate_answers_each_line_at_a_terminal(monkeypatch):
    """At a terminal every line is translated as it is typed, not after --batch-lines lines."""
    from aiayn.commands import translate

    batches = []
    monkeypatch.setattr(translate, "_flush", lambda inference, tokenizer, prefix, lines, args:
                        batches.append(list(lines)))
    monkeypatch.setattr(translate.engine, "engine", lambda model, args: None)
    monkeypatch.setattr("aiayn.tasks.checkpoints.load_model_dir", lambda *a, **k: Loaded())
    monkeypatch.setattr("aiayn.tasks.checkpoints.directory_task", lambda path: "translation")
    monkeypatch.setattr("aiayn.tasks.checkpoints.set_languages", lambda *a: None)
    stdin_of(monkeypatch, b"one\ntwo\nthree\n", tty=True)
    assert translate.run(build(["translate", "RUN"])) == 0
    assert batches == [["one"], ["two"], ["three"]]


def test_classify_takes_threads(classifier, monkeypatch, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert main(["classify", str(classifier), "--threads", "1", "--text", "http server"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.count("\t") == 1


def test_the_chat_reads_stdin_as_every_command_does():
    """--chat -: a leading byte-order mark is not part of the first message, and a line that is
    not UTF-8 is an error naming it (was: a tokenizer's TypeError)."""
    from aiayn.commands.chat_loop import lines

    assert list(lines(io.BytesIO("\ufeffhello\n\n  there \n".encode()), None)) == ["hello",
                                                                                   "there"]
    assert list(lines(io.StringIO("hi\n"), None)) == ["hi"]
    with pytest.raises(ValueError, match=r"stdin:2: not UTF-8 text \(byte 0xe9 at column 4\)"):
        list(lines(io.BytesIO(b"A\ncaf\xe9 au lait\nB\n"), None))


def test_output_paths_that_are_not_plain_files(tmp_path, capfdbinary):
    """--output: '-' is stdout, a FIFO is written through (nothing to replace), a symbolic link
    keeps pointing at its file, which gets the new content; new files get the umask's mode."""
    from aiayn.training.checkpoint import write_output

    write_output("-", b"to stdout\n")
    assert capfdbinary.readouterr().out == b"to stdout\n"

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_output(fifo, b"through a pipe\n")
    reader.join(timeout=30)
    assert got == [b"through a pipe\n"] and stat.S_ISFIFO(fifo.stat().st_mode)

    target, link = tmp_path / "target.txt", tmp_path / "link.txt"
    target.write_bytes(b"old\n")
    link.symlink_to(target)
    write_output(link, b"new\n")
    assert link.is_symlink() and target.read_bytes() == b"new\n"

    previous = os.umask(0o022)
    try:
        write_output(tmp_path / "plain.txt", b"x\n")
        assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == 0o644
    finally:
        os.umask(previous)


def test_run_files_and_checkpoints_get_the_umasks_permissions(tmp_path):
    """A run's files and checkpoint directories were 0600 / 0700 (mkstemp / mkdtemp): unreadable
    by anyone but their owner, whatever the umask said."""
    import torch

    from aiayn.training.checkpoint import atomic_write_bytes, save_weights, write_checkpoint

    previous = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "run.json", b"{}\n")
        model = torch.nn.Linear(2, 2)
        save_weights(model, tmp_path / "model.safetensors")
        step = write_checkpoint(tmp_path / "checkpoints", 1, model, {"t": torch.zeros(1)}, {})
    finally:
        os.umask(previous)
    for path in (tmp_path / "run.json", tmp_path / "model.safetensors",
                 step / "trainer_state.json", step / "trainer_state.safetensors",
                 step / "model.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE(step.stat().st_mode) == 0o755
