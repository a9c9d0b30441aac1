"""Image classification with a Vision Transformer, on scikit-learn's digits or a folder of images.

``aiayn train image-classification [--data sklearn:digits|DIR] --out RUN_DIR`` and, through
``aiayn evaluate RUN_DIR --data sklearn:digits|DIR``, accuracy, macro-F1 and the confusion matrix
of the held-out test images. DIR holds one sub-folder of images per class (docs/vision.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aiayn.commands.train import describe_recipes, fill_unset

WRITES_OUTPUTS = True  # `aiayn evaluate --output`: each image's label and probability, one a line

# Training defaults for the ViT (the shared defaults are the paper's translation settings): AdamW
# (0.9, 0.999) with warm-up + cosine decay, weight decay and clipping at norm 1, near the ViT
# paper's recipe (appendix B.1); the run keeps the checkpoint with the best validation accuracy.
DEFAULTS = dict(preset="vit-digits", steps=1500, optimizer="adamw", betas=(0.9, 0.999),
                adam_eps=1e-8, weight_decay=0.05, schedule="warmup_cosine", warmup=100, lr=2e-3,
                min_lr=1e-5, clip_norm=1.0, eval_every=100, save_every=500, log_every=50,
                keep_last=2, best_metric="accuracy", best_mode="max")

# The peak and floor of the cosine, filled after parsing so that a lower --lr scales the floor.
SCHEDULE_RECIPE = {name: DEFAULTS[name] for name in ("lr", "min_lr")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from aiayn.data.images import DIGITS, DIGITS_SPLIT

    parser.set_defaults(**{**DEFAULTS, **dict.fromkeys(SCHEDULE_RECIPE)})  # preset_defaults
    describe_recipes(parser, {"": SCHEDULE_RECIPE})
    group = parser.add_argument_group("image data")
    group.add_argument("--data", default=DIGITS, metavar="DIR",
                       help=f"a folder with one sub-folder of images per class (read with "
                            f"Pillow, converted and resized to the model's num_channels and "
                            f"image_size), or {DIGITS}: scikit-learn's 1,797 8x8 digits")
    group.add_argument("--valid-fraction", type=float, default=DIGITS_SPLIT["valid_fraction"],
                       help="stratified validation share")
    group.add_argument("--test-fraction", type=float, default=DIGITS_SPLIT["test_fraction"],
                       help="stratified test share (held out; scored by 'aiayn evaluate')")
    group.add_argument("--split-seed", type=int, default=DIGITS_SPLIT["seed"],
                       help="seed of the stratified split")
    group.add_argument("--batch-size", type=int, default=64, help="images per batch")
    group.add_argument("--label-smoothing", type=float, default=0.0)


def preset_defaults(args: argparse.Namespace) -> None:
    """--lr and --min-lr from the recipe where the command line gives none (``fill_unset``)."""
    fill_unset(args, SCHEDULE_RECIPE)


def make_task(args: argparse.Namespace):
    from aiayn.commands.train import parse_overrides
    from aiayn.config import TransformerConfig
    from aiayn.data.images import load_images, split_images
    from aiayn.data.labels import LabelMap
    from aiayn.tasks.image_classification import ImageClassificationTask
    from aiayn.training.devices import default_device

    config = TransformerConfig.preset(args.preset, **parse_overrides(args.set))
    data = load_images(args.data, image_size=config.image_size, channels=config.num_channels)
    split = {"valid_fraction": args.valid_fraction, "test_fraction": args.test_fraction,
             "seed": args.split_seed}
    parts = split_images(data, **split)
    if len(parts["valid"]) == 0:
        raise ValueError(f"{args.data}: too few images for a validation split "
                         f"({len(parts['train'])} training images left, --valid-fraction "
                         f"{args.valid_fraction:g})")
    labels = LabelMap.from_labels(parts["train"].labels)
    if len(labels) < 2:
        raise ValueError(f"{args.data}: classification needs at least 2 classes, found only "
                         f"{list(labels.names)}")
    device = default_device(args.device)
    counts = {name: len(part) for name, part in parts.items()}
    print(f"image-classification: {args.data}: {counts['train']} train / {counts['valid']} valid "
          f"/ {counts['test']} test images of {config.image_size}x{config.image_size}x"
          f"{config.num_channels}, {len(labels)} classes", file=sys.stderr)
    return ImageClassificationTask(
        train=parts["train"], valid=parts["valid"], labels=labels, batch_size=args.batch_size,
        seed=args.seed, device=device, label_smoothing=args.label_smoothing, data=args.data,
        split=split, data_info={"images": counts})


def evaluation_images(data: str, run, split: str):
    """The images of ``data`` to score and a description: the run's stratified ``split`` of them
    (so the training data gives the very images held out in training), or all with "all"."""
    from aiayn.data.images import DIGITS_SPLIT, load_images, split_images

    config = run.model_config
    images = load_images(data, image_size=config.image_size, channels=config.num_channels)
    if split == "all":
        return images, "all images"
    if split not in ("train", "valid", "test"):
        raise ValueError(f"--split must be train, valid, test or all, got {split!r}")
    settings = run.assets.split or DIGITS_SPLIT
    return split_images(images, **settings)[split], f"stratified {split} split {settings}"


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy and macro-F1 of RUN_DIR on ``--data``; prints the confusion matrix (stderr) and
    saves it (TSV + JSON) under RUN_DIR/evaluation/."""
    from aiayn.tasks.image_classification import score
    from aiayn.commands.train_classification import save_report
    from aiayn.training.checkpoint import write_output
    from aiayn.training.run import load_run

    if len(args.data) != 1:
        raise ValueError(f"image classification evaluates one data source, got "
                         f"{len(args.data)}")
    run = load_run(args.run_dir, task="image-classification")
    images, which = evaluation_images(args.data[0], run, args.split)
    if args.limit:
        images = images.subset(list(range(min(args.limit, len(images)))))
    run.model.to(args.device)
    report, probabilities = score(run.model, run.assets, images, device=args.device)
    print(report.confusion_table(), file=sys.stderr)
    save_report(Path(args.run_dir), f"{Path(args.data[0]).name.replace(':', '-')}.{args.split}",
                report, {"data": args.data[0], "images": which})
    if args.output:
        lines = [f"{source}\t{run.assets.labels.name(int(i))}\t{float(p):.6f}"
                 for source, p, i in zip(images.sources, *probabilities.max(-1))]
        write_output(args.output, ("\n".join(lines) + "\n").encode("utf-8"))
    return {"task": "image-classification", "data": args.data[0], "split": args.split,
            "images": len(images), "accuracy": report.accuracy, "macro_f1": report.macro_f1}
