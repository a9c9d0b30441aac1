"""Text classification from a labelled TSV (text<TAB>label), from scratch or from a pretrained encoder.

``aiayn train classification --data TSV --out RUN_DIR [--init DIR] [--pooling mean|first]`` and,
through ``aiayn evaluate RUN_DIR --data TSV``, accuracy, macro-F1 and the confusion matrix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aiayn.commands.train import describe_recipes, fill_unset

WRITES_OUTPUTS = True  # `aiayn evaluate --output`: each text's label and probability, one a line
EVALUATE_OPTIONS = frozenset({"max_tokens"})  # `aiayn evaluate`: batches of 8x this many tokens
BUNDLED_DATA = Path(__file__).resolve().parents[3] / "data" / "debian_sections_topical.tsv.gz"

# Training defaults for classification (the shared defaults are the paper's translation settings):
# AdamW with warm-up + cosine decay and clipping, as BERT fine-tuning does; the run keeps the
# checkpoint with the best validation macro-F1.
DEFAULTS = dict(preset="encoder-small", optimizer="adamw", betas=(0.9, 0.999), adam_eps=1e-8,
                weight_decay=0.01, schedule="warmup_cosine", clip_norm=1.0, keep_last=2,
                best_metric="macro_f1", best_mode="max")
# The settings that differ between training from scratch and fine-tuning a Hugging Face checkpoint
# (--init DIR with a config.json), each applied where the command line leaves it unset. FINE_TUNING
# was chosen on the validation split of the bundled data for all-MiniLM-L6-v2 among runs of under
# 10 minutes on 2 CPU cores (docs/classification.md has the candidates): every layer (the
# embeddings stay), lr 1.5e-4 (the new head 10x that), 192 tokens, batches of 16, 3 epochs; no
# dropout; bf16 autocast where the device runs bf16 natively ("auto").
FROM_SCRATCH = dict(steps=240, warmup=24, lr=2e-3, min_lr=1e-5, eval_every=80, save_every=80,
                    max_tokens=48, batch_size=32, pooling="mean", train_layers="all",
                    head_lr_scale=1.0, autocast="none")
FINE_TUNING = dict(steps=1242, warmup=75, lr=1.5e-4, min_lr=0.0, eval_every=621, save_every=621,
                   max_tokens=192, batch_size=16, pooling="mean", train_layers="layers",
                   head_lr_scale=10.0, autocast="auto")
# Model config fields FINE_TUNING sets on the checkpoint's config unless --set gives them: without
# dropout a MiniLM step on the CPU runs 1.65x faster in float32 and 1.9x under bf16 (sampling the
# masks is slow there; benchmarks/minilm_step.py), so more epochs fit; the candidates that chose
# this recipe (docs/classification.md) were all measured without it.
FINE_TUNING_MODEL = dict(dropout=0.0, attention_dropout=0.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**DEFAULTS, **dict.fromkeys(FROM_SCRATCH))
    group = parser.add_argument_group("classification data")
    group.add_argument("--data", default=None, metavar="TSV",
                       help="labelled TSV: text<TAB>label rows, optional header (text, label, "
                            "optional split column), .gz allowed (default: the bundled Debian "
                            "sections data)")
    group.add_argument("--valid-fraction", type=float, default=0.1,
                       help="stratified validation share when the file has no split column")
    group.add_argument("--test-fraction", type=float, default=0.1,
                       help="stratified test share (held out; scored by 'aiayn evaluate')")
    group.add_argument("--split-seed", type=int, default=0, help="seed of the stratified split")
    group.add_argument("--vocab-size", type=int, default=8000,
                       help="WordPiece vocabulary trained on the training texts (not with --init)")
    group.add_argument("--cased", action="store_true", help="keep case (default: lower-case)")
    group.add_argument("--max-tokens", type=int, default=None,
                       help="ids per text at most, [CLS] and [SEP] included (longer texts are cut)")
    group.add_argument("--batch-size", type=int, default=None, help="texts per batch")
    group = parser.add_argument_group("model")
    group.add_argument("--pooling", choices=("first", "mean"), default=None,
                       help="classify the first ([CLS]) hidden state or the mean of all")
    group.add_argument("--init", default=None, metavar="DIR",
                       help="start from a pretrained encoder: an aiayn 'mlm' run directory or a "
                            "Hugging Face BERT directory (its tokenizer comes along; the preset "
                            "is ignored, --set still applies)")
    group.add_argument("--label-smoothing", type=float, default=0.0)
    group.add_argument("--train-layers", type=_layer_count, default=None, metavar="K",
                       help="train only the top K encoder layers and the head (the embeddings and "
                            "the layers below stay as initialised; cheaper steps), 'layers' "
                            "(every layer and the head; the embeddings stay) or 'all'")
    group.add_argument("--head-lr-scale", type=float, default=None, metavar="F",
                       help="the classification head's learning rate is F times the schedule's")
    describe_recipes(parser, {"from scratch or an aiayn run": FROM_SCRATCH,
                              "with --init a Hugging Face checkpoint": FINE_TUNING})


def _layer_count(text: str) -> int | str:
    if text in ("all", "layers"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a count >= 0, 'layers' or 'all', got {text!r}")
    return value


def apply_recipe(args: argparse.Namespace) -> bool:
    """Fill each recipe setting the command line left unset: FINE_TUNING with --init a Hugging Face
    checkpoint, else FROM_SCRATCH (also from an aiayn mlm run: a small encoder of aiayn's size,
    which the smaller learning rate of FINE_TUNING leaves far behind, docs/classification.md).
    Returns whether the fine-tuning recipe applies."""
    from aiayn.training.run import RUN_FILE

    pretrained = args.init is not None and not (Path(args.init) / RUN_FILE).is_file()
    fill_unset(args, FINE_TUNING if pretrained else FROM_SCRATCH)
    return pretrained


def training_attention(autocast: str | None, device_type: str) -> str | None:
    """The attention kernel a fine-tuning run trains with, beside the checkpoint's own (which the
    run keeps for inference): eq. 1 written out ("reference") for a bf16 step on the CPU, whose
    backward pass runs there 1.8x faster than the fused kernel's (benchmarks/minilm_step.py; in
    float32, and for inference, the fused kernel is the faster). None: the config's kernel."""
    return "reference" if autocast == "bf16" and device_type == "cpu" else None


def resolve_data(path: str | None) -> Path:
    if path is not None:
        return Path(path)
    if BUNDLED_DATA.is_file():
        return BUNDLED_DATA
    raise ValueError("--data is required (the bundled data is only in a source checkout)")


def held_out_keys(data) -> list[str]:
    """What makes two rows the same text for the split (``stratified_split``'s keys): the text
    with its spaces stripped, so a repeated text never lands in training and a held-out part."""
    return [text.strip() for text in data.texts]


def load_splits(path: Path, *, valid_fraction: float, test_fraction: float, seed: int):
    """(rows, {train, valid, test} LabelledTexts, split settings or None when the file has a
    split column)."""
    from aiayn.data.labelled_tsv import read_labelled_tsv
    from aiayn.data.splits import stratified_split

    data = read_labelled_tsv(path)
    if data.splits is not None:
        return data, {name: data.split(name) for name in ("train", "valid", "test")}, None
    parts = stratified_split(data.labels, valid_fraction=valid_fraction,
                             test_fraction=test_fraction, seed=seed, keys=held_out_keys(data))
    split = {"valid_fraction": valid_fraction, "test_fraction": test_fraction, "seed": seed}
    return data, {name: data.subset(list(parts.part(name)))
                  for name in ("train", "valid", "test")}, split


def make_task(args: argparse.Namespace):
    import torch

    from aiayn.commands.train import parse_overrides
    from aiayn.data.labels import LabelMap
    from aiayn.data.wordpiece import TOKENIZER_FILE, WordPieceTokenizer
    from aiayn.tasks.classification import ClassificationTask
    from aiayn.tasks.pretrained import load_pretrained_encoder
    from aiayn.training.checkpoint import sha256_file
    from aiayn.training.devices import default_device
    from aiayn.training.precision import resolve_autocast

    max_tokens_given = args.max_tokens is not None
    fine_tuning = apply_recipe(args)
    device = default_device(args.device)
    if not args.head_lr_scale > 0:
        raise ValueError(f"--head-lr-scale must be positive, got {args.head_lr_scale}")
    args.lr_scales = {} if args.head_lr_scale == 1 else {"head.": args.head_lr_scale}
    autocast = resolve_autocast(args.autocast, device)
    args.autocast = autocast or "none"
    path = resolve_data(args.data)
    _, parts, split = load_splits(path, valid_fraction=args.valid_fraction,
                                  test_fraction=args.test_fraction, seed=args.split_seed)
    if len(parts["valid"]) == 0:
        if split is None:
            raise ValueError(f"{path}: no validation rows (its split column has no 'valid' rows)")
        raise ValueError(f"{path}: too few rows for a validation split ({len(parts['train'])} "
                         f"training rows left, --valid-fraction {split['valid_fraction']:g}); "
                         f"give more rows or a split column")
    labels = LabelMap.from_labels(parts["train"].labels)
    if len(labels) < 2:  # one class: nothing to learn, every prediction trivially right
        raise ValueError(f"{path}: classification needs at least 2 labels in the training rows, "
                         f"found only {list(labels.names)}")
    pretrained, train_attention = None, None
    out = Path(args.out)
    if args.init:
        pretrained = load_pretrained_encoder(args.init)
        overrides = parse_overrides(args.set)
        recipe = FINE_TUNING_MODEL if fine_tuning else {}
        pretrained.config = pretrained.config.replace(**{**recipe, **overrides})
        if fine_tuning and "attention" not in overrides:
            train_attention = training_attention(autocast, torch.device(device).type)
        tokenizer = pretrained.tokenizer
        if not max_tokens_given:  # the recipe's length, within the checkpoint's positions
            args.max_tokens = min(args.max_tokens, pretrained.config.max_length)
    elif (out / TOKENIZER_FILE).is_file() and (out / "checkpoints").is_dir():
        tokenizer = WordPieceTokenizer.load(out / TOKENIZER_FILE)  # resuming: the same ids
    else:
        tokenizer = WordPieceTokenizer.train(parts["train"].texts, vocab_size=args.vocab_size,
                                             lowercase=not args.cased)
    data_info = {"data": str(path), "data_sha256": sha256_file(path),
                 "rows": {name: len(rows) for name, rows in parts.items()}}
    print(f"classification: {path}: {len(parts['train'])} train / {len(parts['valid'])} valid / "
          f"{len(parts['test'])} test rows, {len(labels)} labels, vocabulary "
          f"{tokenizer.vocab_size}" + (f", init {pretrained.source}" if pretrained else "")
          + (f", {autocast} autocast" if autocast else ""),
          file=sys.stderr)
    return ClassificationTask(
        train=parts["train"], valid=parts["valid"], labels=labels, tokenizer=tokenizer,
        max_tokens=args.max_tokens, batch_size=args.batch_size, seed=args.seed, device=device,
        label_smoothing=args.label_smoothing, split=split, pretrained=pretrained,
        pooling=args.pooling, data_info=data_info,
        trainable_layers=None if args.train_layers == "all" else args.train_layers,
        training_attention=train_attention)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy and macro-F1 of RUN_DIR on ``--data``; prints the confusion matrix (stderr) and
    saves it (TSV + JSON) under RUN_DIR/evaluation/."""
    from aiayn.data.labelled_tsv import read_labelled_tsv
    from aiayn.tasks.classification import score
    from aiayn.training.checkpoint import write_output
    from aiayn.tasks.checkpoints import load_model_dir

    if len(args.data) != 1:
        raise ValueError(f"classification evaluates one TSV file, got {len(args.data)} paths")
    path = Path(args.data[0])
    run = load_model_dir(args.run_dir, task="classification")
    assets = run.assets
    rows, which = _evaluation_rows(read_labelled_tsv(path), assets.split, args.split)
    if args.limit:
        rows = rows.subset(list(range(min(args.limit, len(rows)))))
    if len(rows) == 0:
        raise ValueError(f"{path}: no rows in split {args.split!r}")
    run.model.to(args.device)
    report, probabilities = score(run.model, assets, rows, device=args.device,
                                  tokens_per_batch=max(args.max_tokens, assets.max_tokens) * 8)
    print(report.confusion_table(), file=sys.stderr)
    if (Path(args.run_dir) / "run.json").is_file():  # not into a checkpoint directory
        save_report(Path(args.run_dir), f"{path.name.split('.')[0]}.{args.split}", report,
                    {"data": str(path), "rows": which})
    if args.output:
        lines = [f"{assets.labels.name(int(i))}\t{float(p):.6f}"
                 for p, i in zip(*probabilities.max(-1))]
        write_output(args.output, ("\n".join(lines) + "\n").encode("utf-8"))
    return {"task": "classification", "data": str(path), "split": args.split, "rows": len(rows),
            "accuracy": report.accuracy, "macro_f1": report.macro_f1}


def save_report(run_dir: Path, stem: str, report: Any, details: dict[str, Any]) -> None:
    """RUN_DIR/evaluation/STEM.confusion.tsv and STEM.json; where the run directory cannot be
    written (a shared, read-only model) a warning, since the scores are printed anyway."""
    from aiayn.training.checkpoint import atomic_write_bytes, atomic_write_json

    directory = run_dir / "evaluation"
    try:
        directory.mkdir(exist_ok=True)
        atomic_write_bytes(directory / f"{stem}.confusion.tsv", report.confusion_tsv().encode())
        atomic_write_json(directory / f"{stem}.json", {**details, **report.to_dict()})
    except OSError as error:
        print(f"aiayn evaluate: warning: the confusion matrix was not saved ({error})",
              file=sys.stderr)
        return
    print(f"saved {directory / (stem + '.confusion.tsv')} and {stem}.json", file=sys.stderr)


def _evaluation_rows(data, split_settings: dict[str, Any] | None, split: str):
    """The rows to score: the file's split column, else the run's stratified split of the file
    (so the training file gives the very test rows held out in training), or all rows."""
    from aiayn.data.splits import stratified_split

    if split == "all":
        return data, "all rows"
    if data.splits is not None:
        return data.split(split), f"split column = {split}"
    settings = split_settings or {"valid_fraction": 0.1, "test_fraction": 0.1, "seed": 0}
    parts = stratified_split(data.labels, valid_fraction=settings["valid_fraction"],
                             test_fraction=settings["test_fraction"], seed=settings["seed"],
                             keys=held_out_keys(data))
    return data.subset(list(parts.part(split))), f"stratified {split} split {settings}"
