"""Subcommands of the ``aiayn`` CLI, one module each (see aiayn.cli)."""
