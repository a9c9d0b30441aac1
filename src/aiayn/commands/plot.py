"""``aiayn plot``: the paper's pictures — positions, learning-rate schedule — a run's curves and a
classifier's confusion matrix."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot", help="plot position encodings, the learning-rate schedule or a training run",
        description="Draw the sinusoidal position encoding, the paper's learning-rate schedule "
                    "(eq. 3), or the loss / perplexity / BLEU / accuracy / learning-rate curves of a run.")
    kinds = parser.add_subparsers(dest="figure", metavar="FIGURE", required=True)

    positions = kinds.add_parser(
        "positions", help="the sinusoidal position encoding and the similarity of positions",
        description="Curves of a few dimensions, the (position x dimension) table, and the "
                    "dot product of every pair of positions (paper 3.5).")
    positions.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    positions.add_argument("--length", type=int, default=100, help="positions (default 100)")
    positions.add_argument("--layout", choices=("interleaved", "split"), default="interleaved",
                           help="sin/cos on even/odd dimensions (paper) or in two halves")
    positions.add_argument("--out", required=True, help="output image (.png, .svg, .pdf)")
    positions.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")
    positions.set_defaults(run=run_positions)

    schedule = kinds.add_parser(
        "schedule", help="the paper's learning-rate schedule (eq. 3)",
        description="lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), one curve "
                    "per d_model x warmup pair.")
    schedule.add_argument("--d-model", type=int, nargs="+", default=[512],
                          help="one or more model widths (default 512)")
    schedule.add_argument("--warmup", type=int, nargs="+", default=[4000],
                          help="one or more warmup step counts (default 4000)")
    schedule.add_argument("--steps", type=int, default=20000, help="steps to draw (default 20000)")
    schedule.add_argument("--factor", type=float, default=1.0, help="scale factor (default 1)")
    schedule.add_argument("--out", required=True, help="output image (.png, .svg, .pdf)")
    schedule.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")
    schedule.set_defaults(run=run_schedule)

    curves = kinds.add_parser(
        "run", help="loss, perplexity, BLEU/accuracy and learning rate of a training run",
        description="Read RUN_DIR/log.jsonl (or a given .jsonl file) and draw every loss (and its "
                    "perplexity), score and learning rate over steps.")
    curves.add_argument("run_dir", metavar="RUN_DIR", help="a run directory or a log.jsonl file")
    curves.add_argument("--out", required=True, help="output image (.png, .svg, .pdf)")
    curves.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")
    curves.set_defaults(run=run_curves)

    confusion = kinds.add_parser(
        "confusion", help="the confusion matrix of a classifier's evaluation",
        description="Draw the confusion matrix that 'aiayn evaluate' saved for a classification "
                    "run (RUN_DIR/evaluation/<data>.<split>.json): rows coloured by the share of "
                    "each true label, counts in the cells.")
    confusion.add_argument("report", metavar="EVALUATION_JSON",
                           help="RUN_DIR/evaluation/<data>.<split>.json")
    confusion.add_argument("--title", default=None, help="figure title")
    confusion.add_argument("--out", required=True, help="output image (.png, .svg, .pdf)")
    confusion.add_argument("--dpi", type=int, default=110, help="resolution (default 110)")
    confusion.set_defaults(run=run_confusion)


def run_positions(args: argparse.Namespace) -> int:
    from aiayn.visualise.plots import plot_positions

    path = plot_positions(args.d_model, args.length, args.out, layout=args.layout, dpi=args.dpi)
    print(f"wrote {path}")
    return 0


def run_schedule(args: argparse.Namespace) -> int:
    from aiayn.visualise.plots import plot_schedule

    path = plot_schedule(args.out, d_models=args.d_model, warmups=args.warmup, steps=args.steps,
                         factor=args.factor, dpi=args.dpi)
    print(f"wrote {path}")
    return 0


def run_curves(args: argparse.Namespace) -> int:
    from aiayn.visualise.plots import plot_run

    source = Path(args.run_dir)
    log = source / "log.jsonl" if source.is_dir() else source
    path = plot_run(log, args.out, dpi=args.dpi)
    print(f"wrote {path}")
    return 0


def run_confusion(args: argparse.Namespace) -> int:
    from aiayn.visualise.plots import plot_confusion

    path = plot_confusion(args.report, args.out, title=args.title, dpi=args.dpi)
    print(f"wrote {path}")
    return 0
