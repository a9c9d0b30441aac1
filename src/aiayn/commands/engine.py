"""The inference options every decoding command shares, and the engine they build.

Commands that decode (``translate``, ``evaluate``, ``generate``) run the model through an
``aiayn.fast.InferenceEngine``, so command-line users get its speed without writing code: on a GPU
compiled steps (and CUDA graphs for ``generate``), on the CPU the plain steps unless ``--compile``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="run decoding steps through torch.compile (seconds to compile "
                             "first); default: on a GPU only")


def engine(model, args: argparse.Namespace):
    """An ``InferenceEngine`` for ``model`` with the command line's options."""
    from aiayn.fast import InferenceOptions, prepare_for_inference

    return prepare_for_inference(model, InferenceOptions(compile=args.compile))
