"""The README and docs/ stay true: their quick commands run, their links resolve.

- Every ```python block of the README runs as it is (each in a fresh namespace).
- Every ``aiayn ...`` command of the README (bash blocks, backticks) parses with the real command-line
  parser (sub-command and options exist); ``aiayn --help`` and the ``aiayn plot`` commands that
  draw the paper's figures run (into a temporary directory instead of docs/images).
- Every Markdown link and image in the README and docs/*.md points at a file that exists, and every
  repository path a page names in backticks (``benchmarks/x.py``, ``tests/test_x.py``,
  ``scripts/x.sh``, ``docs/x.md``, ``src/aiayn/...``) exists, unless the line says it was removed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from aiayn.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def readme_commands() -> list[list[str]]:
    """The ``aiayn`` command lines of the README: in its bash blocks (continuation lines joined) and
    in backticks in its text when they have options, except spans that stand for several commands
    (``|``) or leave parts out (``...``)."""
    text = README.read_text(encoding="utf-8")
    commands = [shlex.split(span)[1:] for span in re.findall(r"`(aiayn [^`]+)`", text)
                if " --" in span and "|" not in span and "..." not in span]
    for block in blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if "| aiayn " in line:  # echo "..." | aiayn translate ...
                line = line.split("| ", 1)[1]
            if line.startswith("aiayn "):
                commands.append(shlex.split(line)[1:])
    return commands


@pytest.mark.parametrize("index", range(len(blocks(README.read_text(encoding="utf-8"), "python"))))
def test_readme_python_example_runs(index):
    source = blocks(README.read_text(encoding="utf-8"), "python")[index]
    exec(compile(source, f"README python block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_shows_examples_of_every_family():
    text = "\n".join(blocks(README.read_text(encoding="utf-8"), "python"))
    for name in ("Transformer(", "SequenceClassifier", "MaskedLM", "CausalLM", "llama-char",
                 "t5-cpu", "ImageClassifier"):
        assert name in text, name


def test_readme_commands_parse():
    commands = readme_commands()
    assert len(commands) >= 8, commands
    parser = build_parser()
    for argv in commands:
        if "--help" in argv:  # runs in test_aiayn_help_runs
            continue
        args = parser.parse_args(argv)  # an unknown sub-command or option exits with status 2
        assert getattr(args, "run", None) is not None, argv


def test_aiayn_help_runs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "evaluate", "translate", "generate", "classify", "plot", "attention"):
        assert command in out


def test_readme_plot_commands_draw(tmp_path):
    pytest.importorskip("matplotlib")
    plots = [argv for argv in readme_commands() if argv[:2] in (["plot", "positions"],
                                                                ["plot", "schedule"])]
    assert len(plots) == 2, plots
    for argv in plots:
        out = tmp_path / Path(argv[argv.index("--out") + 1]).name
        argv = [*argv[:argv.index("--out")], "--out", str(out)]
        assert main(argv) == 0
        assert out.stat().st_size > 1000


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NAMED_PATH = re.compile(r"`((?:benchmarks|tests|scripts|docs|src/aiayn|data)/[\w./-]+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_named_files_resolve(page):
    missing = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for target in LINK.findall(line):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.name}:{number}: link {target}")
        if re.search(r"\b(removed|deleted)\b", line):
            continue
        for path in NAMED_PATH.findall(line):
            path = path.rstrip(".")
            if "*" in path or "RUN" in path:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.name}:{number}: {path}")
    assert not missing, "\n".join(missing)
