"""Subcommands of the ``aiayn`` CLI, one module each (see aiayn.cli)."""

import argparse


def summary(doc: str | None, default: str = "") -> str:
    """A module docstring's first paragraph as help text: one line, no reST ``literals``."""
    paragraph = (doc or default).strip().split("\n\n")[0]
    return " ".join(paragraph.split()).replace("``", "")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help states its default already or
    there is none to state (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)
