"""``aiayn evaluate RUN_DIR --data ...``: score a trained run; prints one JSON line.

Dispatches on the task named in RUN_DIR/run.json to that task's module in
``aiayn.commands.train.TASKS`` (its ``evaluate(args) -> dict``).
"""

from __future__ import annotations

import argparse
import json

from aiayn.commands import DefaultsHelpFormatter, engine
from aiayn.commands.train import device_name, positive_int
from aiayn.commands.translate import add_language_arguments

# Options only some tasks read (a task module's EVALUATE_OPTIONS), and their defaults: unset
# unless given, so that one given to a task that does not read it is refused, not dropped
TASK_OPTIONS = {"beam": 4, "alpha": 0.6, "max_tokens": 4000, "compile": False}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate", help="score a trained run on data (prints a JSON line)",
        description="Evaluate the model of RUN_DIR on a data file with the metrics of its task "
                    "(translation: sacreBLEU and chrF of beam or greedy output). Prints one JSON "
                    "line.", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a directory made by 'aiayn train', or "
                        "a Hugging Face checkpoint directory (Marian, BART, T5, mBART, M2M100, "
                        "NLLB, GPT-2, Llama, Mistral, Qwen, Gemma, BERT, DistilBERT, RoBERTa, "
                        "XLM-R, ModernBERT, DeBERTa)")
    parser.add_argument("--data", required=True, nargs="+", metavar="PATH",
                        help="evaluation data in the task's format (translation: a TSV, or a "
                             "source and a target file)")
    parser.add_argument("--split", default=None,
                        help="rows of this split ('all': every row). Translation: default test "
                             "when the data has a split column, else all; asked of data without "
                             "one, the hash split training used. A language model's plain text: "
                             "train / valid (the run's split) or all (the default)")
    add_language_arguments(parser)
    parser.add_argument("--beam", type=positive_int, default=None,
                        help="beam size (1: greedy); translation and text2text (default: 4)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="length penalty (GNMT); translation and text2text (default: 0.6)")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="source tokens per decoding batch (translation, text2text); a "
                             "classification batch holds 8x this many (default: 4000)")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="only the first N examples (a language model: the first N "
                             "characters, or tokens of a token directory)")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write the model outputs (one a line) here: translations "
                             "(translation and text2text runs), labels with their probability "
                             "(classification and image runs); '-': stdout, before the JSON "
                             "line; a file is replaced whole, a pipe or device written through")
    engine.add_arguments(parser, default=None)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.commands.train import available_tasks, task_module
    from aiayn.tasks.checkpoints import directory_task

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    task = directory_task(args.run_dir)
    module = task_module(task) if task != "encoder" else None
    if not hasattr(module, "evaluate"):
        raise ValueError(f"task {task!r} has no evaluation command")
    if task != "translation" and (args.src_lang or args.tgt_lang):
        raise ValueError(f"--src-lang / --tgt-lang apply to translation checkpoints, not to a "
                         f"{task!r} directory")
    if args.output and not getattr(module, "WRITES_OUTPUTS", False):
        raise ValueError(f"--output writes a translation, text2text, classification or image run's "
                         f"outputs; a {task!r} run's evaluation has only scores")
    reads = getattr(module, "EVALUATE_OPTIONS", frozenset())
    for option, default in TASK_OPTIONS.items():
        if getattr(args, option) is None:
            setattr(args, option, default)
        elif option not in reads:
            users = [name for name in available_tasks()
                     if option in getattr(task_module(name), "EVALUATE_OPTIONS", ())]
            raise ValueError(f"--{option.replace('_', '-')} applies to {', '.join(users)} runs; "
                             f"a {task!r} run's evaluation does not use it")
    if args.split is None:  # a module's EVALUATION_SPLIT None: it decides from the data
        args.split = getattr(module, "EVALUATION_SPLIT", "test")
    result = module.evaluate(args)
    print(json.dumps(result))
    return 0
