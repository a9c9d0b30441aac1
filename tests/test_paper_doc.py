"""docs/paper.md stays true: its Python snippets run, its links and images exist."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "paper.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_page_has_the_exercises():
    assert len(SNIPPETS) >= 6
    text = DOC.read_text(encoding="utf-8")
    for section in ("3.2.1", "3.2.2", "3.3", "3.5", "5.3", "5.4", "6.1"):
        assert f"## {section}" in text, section


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index, tmp_path, monkeypatch):
    if "visualise" in SNIPPETS[index]:
        pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)  # snippets that draw write into a temporary directory
    exec(compile(SNIPPETS[index], f"{DOC}:snippet{index}", "exec"), {"__name__": "__snippet__"})
    if "plot_attention_grid" in SNIPPETS[index]:
        assert (tmp_path / "cross.png").stat().st_size > 5000


def test_links_and_images_resolve():
    text = DOC.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#]+)\)", text)
    assert targets
    missing = [target for target in targets if not (DOC.parent / target).exists()]
    assert not missing, missing
