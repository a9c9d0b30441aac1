"""Subcommands of the ``aiayn`` CLI, one module each (see aiayn.cli)."""


def summary(doc: str | None, default: str = "") -> str:
    """A module docstring's first paragraph as help text: one line, no reST ``literals``."""
    paragraph = (doc or default).strip().split("\n\n")[0]
    return " ".join(paragraph.split()).replace("``", "")
