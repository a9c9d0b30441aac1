"""``aiayn attention RUN_DIR --image FILE | --test-image N``: where a trained ViT looks in an image.

The image is read as the run's data was (``aiayn.data.images``: the model's channels and size, the
training images' per-channel statistics), or taken from the run's own held-out test split. Writes
the [CLS] attention of every layer and head, one head large, and the attention rollout, each over
the image (``aiayn.visualise.image_attention``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

TEXT_OPTIONS = (("target", "--target"), ("tokenizer", "--tokenizer"), ("html", "--html"))


def run_image(args: argparse.Namespace) -> int:
    from aiayn.data.images import normalise, read_image
    from aiayn.training.run import load_run
    from aiayn.visualise.image_attention import image_attention, write_image_attention_report

    for name, option in TEXT_OPTIONS:
        if getattr(args, name, None):
            raise ValueError(f"{option} is for texts; an image has only the [CLS] attention")
    if args.kind not in (None, "encoder"):
        raise ValueError(f"--kind {args.kind!r}: a Vision Transformer has encoder attention only")
    run = load_run(args.run_dir)
    if run.task != "image-classification":
        raise ValueError(f"{args.run_dir} is a run of task {run.task!r}; --image and "
                         f"--test-image need an image-classification run")
    config = run.model_config
    if args.image is not None:
        pixels = read_image(args.image, image_size=config.image_size,
                            channels=config.num_channels)  # (C, S, S) in [0, 1]
        source, truth = args.image, None
    else:
        from aiayn.commands.train_image_classification import evaluation_images

        if run.assets.data is None:
            raise ValueError(f"{args.run_dir}: the run does not say what it trained on; give "
                             f"--image FILE")
        test, _ = evaluation_images(run.assets.data, run, "test")
        if not 0 <= args.test_image < len(test):
            raise ValueError(f"--test-image {args.test_image}: the run's test split has images "
                             f"0..{len(test) - 1}")
        pixels = test.images[args.test_image]
        source, truth = test.sources[args.test_image], test.labels[args.test_image]
    attention = image_attention(run.model, normalise(pixels, run.assets.mean, run.assets.std))
    written = write_image_attention_report(
        attention, pixels, args.out, labels=run.assets.labels.names, layer=args.layer,
        head=args.head, dpi=args.dpi, title=f"{Path(args.run_dir).name}: {Path(source).name}")
    for path in written.values():
        print(f"wrote {path}")
    index = int(attention.probabilities.argmax())
    print(f"image {source}" + (f" (label {truth})" if truth is not None else "") +
          f": predicted {run.assets.labels.name(index)} "
          f"(p = {float(attention.probabilities[index]):.3f})")
    return 0
