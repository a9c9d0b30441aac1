"""The inference options every decoding command shares, and the engine they build.

Commands that decode (``translate``, ``evaluate``, ``generate``) run the model through an
``aiayn.fast.InferenceEngine``, so command-line users get its speed without writing code: on a GPU
steps replayed from CUDA graphs, compiled only with ``--compile``. A command runs one job, and
compiling costs more than it saves on a job of the usual size: on an H200, ``aiayn evaluate`` of
the bundled test set (190 sentences, beam 4) took 28.7 s with compiled steps, nearly all of it
compiling, while the graphed beam search starts in 0.5 s and runs at 0.87x the compiled speed
(benchmarks/results/gpu/beam.json, main_job.json). The Python API's engine, made once and kept,
compiles on a GPU by default (``InferenceOptions``).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser, *, default: bool | None = False) -> None:
    """``--compile``/``--no-compile``; ``default`` None: unset unless given (a command that
    fills it per task)."""
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default,
                        help="run decoding steps through torch.compile: tens of seconds to "
                             "compile first, then up to 1.5x faster steps; pays off on long "
                             "jobs (default: off; on a GPU the steps replay CUDA graphs "
                             "either way)")


def engine(model, args: argparse.Namespace):
    """An ``InferenceEngine`` for ``model`` with the command line's options."""
    from aiayn.fast import InferenceOptions, prepare_for_inference

    return prepare_for_inference(model, InferenceOptions(compile=bool(args.compile)))
