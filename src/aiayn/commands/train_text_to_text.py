"""Text-to-text (T5): translation and Debian-sections classification in one model, as prefixed text.

``aiayn train text2text --out RUN_DIR`` trains a small T5-style encoder-decoder (preset ``t5-cpu``)
on the bundled English-German pairs ("translate English to German: ...") and Debian package
sections ("debian section: ..." -> the section name) at once; ``--tasks translation`` or ``--tasks
classification`` trains the single-task model of the same size. ``aiayn evaluate RUN_DIR --data
TSV [TSV]`` scores the test split of each file: sacreBLEU and chrF of the translations, accuracy of
the generated section names. The splits are the translation and classification commands' own, so
the test rows are theirs too (docs/t5.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from aiayn.commands.train import add_embedding_lr_scale, embedding_lr_scales

DATA = Path(__file__).resolve().parents[3] / "data"
BUNDLED = {"translation": DATA / "ddtp_en_de.tsv.gz",
           "classification": DATA / "debian_sections_topical.tsv.gz"}
PREFIXES = {"translation": "translate English to German: ", "classification": "debian section: "}
WRITES_OUTPUTS = True  # `aiayn evaluate --output`: the generated texts, one a line, file by file
# `aiayn evaluate`'s decoding options this task reads (the others are refused)
EVALUATE_OPTIONS = frozenset({"beam", "alpha", "max_tokens", "compile"})
# the classification command's stratified split (train_classification.py defaults): same test rows
CLASSIFICATION_SPLIT = dict(valid_fraction=0.1, test_fraction=0.1, seed=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("text-to-text data")
    group.add_argument("--tasks", nargs="+", choices=tuple(BUNDLED), default=list(BUNDLED),
                       help="the tasks mixed into training (one: a single-task model)")
    for kind, path in BUNDLED.items():
        group.add_argument(f"--{kind}-data", default=None, metavar="TSV",
                           help=f"{kind} TSV (default: the bundled {path.name})")
        group.add_argument(f"--{kind}-prefix", default=PREFIXES[kind],
                           help=f"text put before each {kind} source")
    group.add_argument("--vocab-size", type=int, default=8000, help="joint BPE vocabulary")
    group.add_argument("--max-tokens", type=int, default=2500,
                       help="padded tokens per side in a batch")
    group.add_argument("--max-length", type=int, default=128,
                       help="subwords per side: longer translation pairs are dropped, longer "
                            "classification texts cut")
    group.add_argument("--label-smoothing", type=float, default=0.1)
    group.add_argument("--valid-sentences", type=int, default=200,
                       help="validation translations decoded (greedy) for BLEU at each evaluation")
    add_embedding_lr_scale(group)
    # The translation command's schedule (docs/translation.md), a T5-style model of mt-cpu's size.
    parser.set_defaults(preset="t5-cpu", steps=3000, warmup=400, lr_factor=0.5, clip_norm=1.0,
                        eval_every=500, save_every=500, log_every=20)


def data_path(args: argparse.Namespace, kind: str) -> Path:
    path = getattr(args, f"{kind}_data", None)
    if path is not None:
        return Path(path)
    if BUNDLED[kind].is_file():
        return BUNDLED[kind]
    raise ValueError(f"--{kind}-data is required (the bundled data is only in a source checkout)")


def splits(kind: str, path: Path) -> dict[str, Any]:
    """{train, valid, test}: translation pairs (the file's split column or the translation
    task's hash split) or classification rows (the classification command's stratified split)."""
    if kind == "translation":
        from aiayn.data.parallel import read_pairs, split_pairs

        return split_pairs(read_pairs([path]))
    from aiayn.commands.train_classification import load_splits

    return load_splits(path, **CLASSIFICATION_SPLIT)[1]


def examples(kind: str, rows: Any, prefix: str) -> list:
    from aiayn.tasks.text_to_text import classification_examples, translation_examples

    build = translation_examples if kind == "translation" else classification_examples
    return build(rows, prefix)


def make_task(args: argparse.Namespace):
    from aiayn.data.tokenizer import TOKENIZER_FILE, SubwordTokenizer
    from aiayn.tasks.text_to_text import TextToTextTask

    args.lr_scales = embedding_lr_scales(args)
    prefixes = {kind: getattr(args, f"{kind}_prefix") for kind in args.tasks}
    train, valid = [], []
    for kind in args.tasks:
        parts = splits(kind, data_path(args, kind))
        train += examples(kind, parts["train"], prefixes[kind])
        valid += examples(kind, parts["valid"], prefixes[kind])
    saved = Path(args.out) / TOKENIZER_FILE
    if saved.is_file() and (Path(args.out) / "checkpoints").is_dir():
        tokenizer = SubwordTokenizer.load(saved)  # resuming: the same ids
    else:
        tokenizer = SubwordTokenizer.train([e.source for e in train] + [e.target for e in train],
                                           vocab_size=args.vocab_size)
    print(f"text2text: {', '.join(args.tasks)}: {len(train)} train / {len(valid)} valid examples, "
          f"vocabulary {tokenizer.vocab_size}", file=sys.stderr)
    return TextToTextTask(train=train, valid=valid, tokenizer=tokenizer, prefixes=prefixes,
                          max_tokens=args.max_tokens, max_length=args.max_length,
                          label_smoothing=args.label_smoothing,
                          valid_sentences=args.valid_sentences, seed=args.seed,
                          device=args.device)


def kind_of(path: Path, trained: Collection[str]) -> str:
    """What ``path`` holds, for a run trained on the kinds ``trained``: "classification" for a
    labelled TSV (a header naming text and label), "translation" for a parallel TSV (a header
    naming a source, target or split column). A file without either header is the run's one kind;
    for a run trained on both it is an error (a headerless ``text<TAB>label`` file reads like a
    pair of sentences)."""
    from aiayn.data.parallel import is_pair_header
    from aiayn.data.text_files import read_lines

    for _, line in read_lines(path):
        names = [name.strip().lower() for name in line.split("\t")]
        if {"text", "label"} <= set(names):
            return "classification"
        if is_pair_header(names):
            return "translation"
        if len(trained) == 1:
            return next(iter(trained))
        raise ValueError(f"{path}: no header says whether it holds translation pairs or labelled "
                         f"texts, and the run was trained on both: start it with a header line "
                         f"(text<TAB>label, or src<TAB>tgt)")
    raise ValueError(f"{path}: empty file")


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Test-split scores of RUN_DIR's model on each ``--data`` file (``--split``; greedy unless
    ``--beam``): BLEU/chrF for translation pairs, accuracy for labelled texts."""
    from aiayn.commands.engine import engine
    from aiayn.tasks.text_to_text import generate_examples, score_outputs
    from aiayn.training import load_run
    from aiayn.training.checkpoint import write_output

    if args.split not in ("train", "valid", "test"):
        raise ValueError(f"--split must be train, valid or test for text2text, got {args.split!r}")
    run = load_run(args.run_dir, task="text2text")
    inference = engine(run.model.to(args.device), args)
    result: dict[str, Any] = {"run_dir": str(args.run_dir), "split": args.split,
                              "beam": args.beam}
    start, written = time.perf_counter(), []
    for path in map(Path, args.data):
        kind = kind_of(path, run.assets.prefixes)
        if kind not in run.assets.prefixes:
            raise ValueError(f"{path}: {kind} data, but {args.run_dir} was trained on "
                             f"{sorted(run.assets.prefixes)} only")
        rows = list(examples(kind, splits(kind, path)[args.split], run.assets.prefixes[kind]))
        rows = rows[:args.limit] if args.limit is not None else rows
        outputs = generate_examples(inference.model, run.assets.tokenizer, rows,
                                    beam_size=args.beam, alpha=args.alpha,
                                    max_tokens=args.max_tokens,
                                    max_length=run.assets.max_length, engine=inference)
        written += outputs
        result[kind] = {"data": str(path), "examples": len(rows),
                        **score_outputs(outputs, rows)}
    result["seconds"] = round(time.perf_counter() - start, 2)
    if args.output:
        write_output(args.output, "".join(line + "\n" for line in written).encode("utf-8"))
    return result
