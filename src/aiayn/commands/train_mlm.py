"""Masked-LM pretraining of an encoder on plain text (BERT: 15 percent of tokens masked, 80/10/10).

``aiayn train mlm --data TEXT --out RUN_DIR``: one text per line (a TSV with a ``text`` header column
also works). The run can then start a classifier: ``aiayn train classification --init RUN_DIR``.
With ``--exclude-held-out`` on a labelled TSV, only the rows ``aiayn train classification`` trains on
are read (the same stratified split), so domain pretraining never sees a validation or test text.
``aiayn evaluate RUN_DIR --data TEXT`` reports masked-token loss, perplexity and accuracy.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

from aiayn.commands.train import describe_recipes, fill_unset

DEFAULTS = dict(preset="encoder-small", steps=2000, optimizer="adamw", betas=(0.9, 0.999),
                adam_eps=1e-8, weight_decay=0.01, schedule="warmup_cosine", warmup=100, lr=1e-3,
                min_lr=1e-5, clip_norm=1.0, eval_every=250, save_every=250, keep_last=2,
                best_metric="loss", best_mode="min")
# `aiayn evaluate` scores every text of the file (its only split).
EVALUATION_SPLIT = "all"

# The peak and floor of the cosine, filled after parsing so that a lower --lr scales the floor.
SCHEDULE_RECIPE = {name: DEFAULTS[name] for name in ("lr", "min_lr")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{**DEFAULTS, **dict.fromkeys(SCHEDULE_RECIPE)})  # preset_defaults
    describe_recipes(parser, {"": SCHEDULE_RECIPE})
    group = parser.add_argument_group("masked-LM data")
    group.add_argument("--data", required=True, metavar="TEXT",
                       help="UTF-8 text, one text per line (.gz allowed; a .tsv uses its 'text' "
                            "column)")
    group.add_argument("--valid-fraction", type=float, default=0.05,
                       help="random share of the texts held out for validation")
    group.add_argument("--vocab-size", type=int, default=8000, help="WordPiece vocabulary size")
    group.add_argument("--cased", action="store_true", help="keep case (default: lower-case)")
    group.add_argument("--max-tokens", type=int, default=128,
                       help="ids per text at most, [CLS] and [SEP] included")
    group.add_argument("--batch-size", type=int, default=32, help="texts per batch")
    group.add_argument("--mask-probability", type=float, default=0.15,
                       help="share of tokens chosen as targets (BERT: 0.15)")
    group.add_argument("--exclude-held-out", action="store_true",
                       help="--data is a labelled TSV: pretrain only on the training rows of the "
                            "split 'aiayn train classification' makes of it (its split column, or "
                            "the stratified split of --held-out-fractions and --split-seed)")
    group.add_argument("--held-out-fractions", type=float, nargs=2, default=(0.1, 0.1),
                       metavar=("VALID", "TEST"),
                       help="with --exclude-held-out: the classifier's valid and test fractions")
    group.add_argument("--split-seed", type=int, default=0,
                       help="with --exclude-held-out: the classifier's split seed")


def preset_defaults(args: argparse.Namespace) -> None:
    """--lr and --min-lr from the recipe where the command line gives none (``fill_unset``)."""
    fill_unset(args, SCHEDULE_RECIPE)


def make_task(args: argparse.Namespace):
    from aiayn.data.masking import MaskingRule
    from aiayn.data.text_corpus import read_texts
    from aiayn.data.wordpiece import TOKENIZER_FILE, WordPieceTokenizer
    from aiayn.tasks.masked_lm import MaskedLMTask
    from aiayn.training.checkpoint import sha256_file
    from aiayn.training.devices import default_device

    if not 0.0 < args.valid_fraction < 1.0:
        raise ValueError(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    if args.exclude_held_out:
        from aiayn.commands.train_classification import load_splits

        valid_fraction, test_fraction = args.held_out_fractions
        _, parts, _ = load_splits(Path(args.data), valid_fraction=valid_fraction,
                                  test_fraction=test_fraction, seed=args.split_seed)
        texts = list(parts["train"].texts)
    else:
        texts = read_texts(args.data)
    if len(texts) < 2:
        raise ValueError(f"{args.data}: masked LM needs at least 2 texts (train and valid), got "
                         f"{len(texts)}")
    order = list(range(len(texts)))
    random.Random(args.seed).shuffle(order)
    n_valid = max(1, round(len(texts) * args.valid_fraction))
    valid = [texts[i] for i in sorted(order[:n_valid])]
    train = [texts[i] for i in sorted(order[n_valid:])]
    out = Path(args.out)
    if (out / TOKENIZER_FILE).is_file() and (out / "checkpoints").is_dir():
        tokenizer = WordPieceTokenizer.load(out / TOKENIZER_FILE)  # resuming: the same ids
    else:
        tokenizer = WordPieceTokenizer.train(train, vocab_size=args.vocab_size,
                                             lowercase=not args.cased)
    print(f"mlm: {args.data}: {len(train)} train / {len(valid)} valid texts, vocabulary "
          f"{tokenizer.vocab_size}", file=sys.stderr)
    return MaskedLMTask(
        train=train, valid=valid, tokenizer=tokenizer, max_tokens=args.max_tokens,
        batch_size=args.batch_size, seed=args.seed,
        device=default_device(args.device),
        rule=MaskingRule(probability=args.mask_probability),
        data_info={"data": str(args.data), "data_sha256": sha256_file(args.data),
                   "texts": {"train": len(train), "valid": len(valid)},
                   "held_out_excluded": {"fractions": list(args.held_out_fractions),
                                         "seed": args.split_seed}
                   if args.exclude_held_out else None})


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Masked-token loss, perplexity and accuracy of RUN_DIR on all texts of ``--data`` (one fixed
    corruption, seed 0)."""
    import torch

    from aiayn.data.text_corpus import read_texts
    from aiayn.tasks.masked_lm import MaskedLMTask
    from aiayn.tasks.checkpoints import load_model_dir

    if len(args.data) != 1:
        raise ValueError(f"mlm evaluates one text file, got {len(args.data)} paths")
    if args.split != EVALUATION_SPLIT:
        raise ValueError(f"a masked-LM run is evaluated on every text of --data; --split "
                         f"{args.split!r} is not supported (leave --split out)")
    run = load_model_dir(args.run_dir, task="mlm")
    texts = list(read_texts(args.data[0]))
    if args.limit:
        texts = texts[:args.limit]
    run.model.to(args.device)
    task = MaskedLMTask(train=texts, valid=texts, tokenizer=run.assets.tokenizer,
                        max_tokens=run.assets.max_tokens, device=args.device,
                        rule=run.assets.rule)  # masked as the run was validated
    with torch.no_grad():
        metrics = task.evaluate(run.model)
    return {"task": "mlm", "data": args.data[0], "split": "all", "texts": len(texts), **metrics}
