"""The inference options every decoding command shares, and the engine they build.

Commands that decode (``translate``, ``evaluate``, ``generate``) run the model through an
``aiayn.fast.InferenceEngine``, so command-line users get the compiled decoding steps without
writing code; ``--no-compile`` runs the plain steps.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, *, compile_default: bool = False) -> None:
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction,
                        default=compile_default,
                        help="run decoding steps through torch.compile (seconds to compile "
                             "first; faster over long outputs)")


def engine(model, args: argparse.Namespace):
    """An ``InferenceEngine`` for ``model`` with the command line's options."""
    from aiayn.fast import InferenceOptions, prepare_for_inference

    return prepare_for_inference(model, InferenceOptions(compile=args.compile))
