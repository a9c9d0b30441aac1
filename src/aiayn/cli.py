"""The ``aiayn`` command line (also ``python -m aiayn``).

Each subcommand is a module in ``aiayn.commands`` with ``register(subparsers)``; it adds its parser and
sets ``run`` (a function of the parsed arguments returning an exit code). Heavy imports stay inside
``run`` so that ``aiayn --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "aiayn.commands.demo",
    "aiayn.commands.train",
    "aiayn.commands.evaluate",
    "aiayn.commands.translate",
    "aiayn.commands.generate",
    "aiayn.commands.classify",
    "aiayn.commands.embed",
    "aiayn.commands.plot",
    "aiayn.commands.attention",
)


def build_parser() -> argparse.ArgumentParser:
    from aiayn import __version__

    parser = argparse.ArgumentParser(
        prog="aiayn", description="The Transformer of 'Attention Is All You Need' on PyTorch.")
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        print(f"{parser.prog}: error: choose a COMMAND", file=sys.stderr)  # usage is on stdout
        return 2
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader has gone (`| head`): stop quietly, as a filter does
        _discard_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a filter its pipe stopped
    # OSError: files not found, and writes that failed (disk full, read-only run directory), whose
    # messages name the path and the reason.
    except (ValueError, OSError, TypeError) as error:
        print(f"aiayn {args.command}: error: {error}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as error:  # an allocation too large for this machine
        if not _out_of_memory(error):
            raise
        print(f"aiayn {args.command}: error: out of memory ({str(error).splitlines()[0][:200]}); "
              f"lower the sizes that set it (--max-tokens, --batch-size, --max-length, "
              f"--set max_length=...)", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit finds no closed pipe
    (Python's documented handling of SIGPIPE)."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (pytest's capture): nothing to flush
        pass


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (CPU, or CUDA's "out of memory"), not another
    runtime error."""
    return isinstance(error, MemoryError) or any(
        text in str(error) for text in ("can't allocate memory", "out of memory"))


if __name__ == "__main__":
    sys.exit(main())
