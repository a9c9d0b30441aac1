"""Translation (paper section 6.1): a parallel corpus to an encoder-decoder model.

CLI glue for ``aiayn train translation`` and ``aiayn evaluate`` on translation runs; the task itself
is ``aiayn.tasks.translation.TranslationTask``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from aiayn.commands.train import (add_embedding_lr_scale, describe_recipes, embedding_lr_scales,
                                  fill_unset)

DEFAULT_PRESET = "mt-cpu"
# The recipe of each device, every setting applied where the command line leaves it unset
# (docs/translation.md). On the CPU, 3000 steps, float32: 9 minutes on 2 cores reach about 1,600
# steps. On CUDA the same model trains for longer, as a GPU runs 30-40 of its steps a second:
# checkpoints every 1000 steps, the last 5 averaged (paper 6.1), bf16 where the card runs it
# natively. On an H200 the 540 s ran 17,239 steps: test BLEU 32.59 greedy / 33.30 beam 4
# (benchmarks/results/gpu/main_job.json).
CPU_RECIPE = dict(steps=3000, eval_every=500, save_every=500, average_last=0, autocast="none")
CUDA_RECIPE = dict(steps=20000, eval_every=1000, save_every=1000, average_last=5,
                   autocast="auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("translation data")
    group.add_argument("--data", required=True, nargs="+", metavar="PATH",
                       help="a TSV (source<TAB>target, optional header with a split column; .gz "
                            "ok) or a source file and a line-aligned target file")
    group.add_argument("--vocab-size", type=int, default=6000, help="joint BPE vocabulary")
    group.add_argument("--max-tokens", type=int, default=2500,
                       help="padded tokens per side in a batch (paper: 25000)")
    group.add_argument("--max-length", type=int, default=128,
                       help="drop training pairs longer than this many subword tokens")
    group.add_argument("--max-ratio", type=float, default=3.0,
                       help="drop training pairs whose length ratio exceeds this")
    group.add_argument("--label-smoothing", type=float, default=0.1, help="paper 5.4: 0.1")
    group.add_argument("--valid-bleu-sentences", type=int, default=200,
                       help="validation sentences decoded (greedy) for BLEU at each evaluation")
    add_embedding_lr_scale(group)
    group.add_argument("--init", default=None, metavar="DIR",
                       help="fine-tune a pretrained model: an aiayn translation run or a Hugging "
                            "Face Marian / BART / T5 / mBART / M2M100 / NLLB checkpoint directory "
                            "(its tokenizer and vocabulary are kept; --preset and --vocab-size "
                            "are ignored, --set applies)")
    group.add_argument("--src-lang", default=None, metavar="CODE",
                       help="with --init of a multilingual checkpoint: the data's source language "
                            "code (NLLB eng_Latn, M2M100 en, mBART en_XX), put in each source "
                            "where the checkpoint's tokenizer puts it; the run keeps it")
    group.add_argument("--tgt-lang", default=None, metavar="CODE",
                       help="with --init of a multilingual checkpoint: the data's target language "
                            "code, the first token of each target (transformers' text_target "
                            "labels) and forced first when the run translates; mBART's own "
                            "tokenizer: the decoder's start symbol")
    # The default preset trains in minutes on a laptop CPU; see docs/translation.md.
    parser.set_defaults(preset=DEFAULT_PRESET, warmup=400, lr_factor=0.5, clip_norm=1.0,
                        best_metric="bleu", best_mode="max", log_every=20,
                        **dict.fromkeys(CPU_RECIPE))
    describe_recipes(parser, {"on the CPU": CPU_RECIPE, "on CUDA": CUDA_RECIPE})


def apply_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """Fill each recipe setting the command line left unset: ``CUDA_RECIPE`` when training runs
    on a CUDA device, else ``CPU_RECIPE``. Returns the settings applied."""
    import torch

    from aiayn.training.devices import default_device

    cuda = torch.device(default_device(args.device)).type == "cuda"
    recipe = CUDA_RECIPE if cuda else CPU_RECIPE
    fill_unset(args, recipe)
    return recipe


def make_task(args: argparse.Namespace):
    from aiayn.commands.train import parse_overrides
    from aiayn.tasks.checkpoints import set_language_pair
    from aiayn.tasks.pretrained import load_pretrained_model
    from aiayn.tasks.translation import TranslationTask

    apply_recipe(args)
    pretrained = None
    if args.init:
        pretrained = load_pretrained_model(args.init, "translation")
        pretrained.config = pretrained.config.replace(**parse_overrides(args.set))
        set_language_pair(pretrained.tokenizer, args.init, args.src_lang, args.tgt_lang)
    elif args.src_lang is not None or args.tgt_lang is not None:
        raise ValueError("--src-lang / --tgt-lang need --init: a multilingual checkpoint (NLLB, "
                         "M2M100, mBART-50, mBART) or a run fine-tuned from one")
    args.lr_scales = embedding_lr_scales(args, pretrained.config if pretrained else None)
    task = TranslationTask(args.data, run_dir=args.out, vocab_size=args.vocab_size,
                           max_tokens=args.max_tokens, max_length=args.max_length,
                           max_ratio=args.max_ratio, label_smoothing=args.label_smoothing,
                           valid_bleu_sentences=args.valid_bleu_sentences, seed=args.seed,
                           device=args.device, pretrained=pretrained)
    if task.filtered and os.environ.get("RANK", "0") == "0":  # counted in run.json too
        total = task.filtered + len(task.train_source)
        print(f"translation: {task.filtered:,} of {total:,} training pairs left out: longer "
              f"than {task.max_length} subwords on a side (--max-length), a length ratio "
              f"above {task.max_ratio} (--max-ratio) or no subwords", file=sys.stderr)
    return task


# `aiayn evaluate`'s --split when not given: decided by the data (``evaluate``).
EVALUATION_SPLIT = None
WRITES_OUTPUTS = True  # `aiayn evaluate --output`: the translations, one a line
# `aiayn evaluate`'s decoding options this task reads (the others are refused)
EVALUATE_OPTIONS = frozenset({"beam", "alpha", "max_tokens", "compile"})


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """BLEU/chrF of RUN_DIR's model on ``args.data``: the rows of ``--split`` (default: test when
    the data has a split column, else every row, e.g. a test set given as two files). Asked of data
    without a split column, a split is the hash split training used (2 % valid, 2 % test)."""
    from aiayn.commands.engine import engine
    from aiayn.data.parallel import read_pairs, select_split
    from aiayn.tasks.translate import score_translations, translate_texts
    from aiayn.tasks.checkpoints import load_model_dir, set_languages
    from aiayn.training.checkpoint import write_output

    run = load_model_dir(args.run_dir, task="translation")
    set_languages(run, getattr(args, "src_lang", None), getattr(args, "tgt_lang", None))
    pairs = read_pairs(args.data)
    has_split = any(pair.split is not None for pair in pairs)
    split = args.split or ("test" if has_split else "all")
    pairs = select_split(pairs, split)
    if args.limit is not None:
        pairs = pairs[:args.limit]
    inference = engine(run.model.to(args.device), args)
    start = time.perf_counter()
    outputs = translate_texts(inference.model, run.assets, [p.source for p in pairs],
                              beam_size=args.beam, alpha=args.alpha, max_tokens=args.max_tokens,
                              engine=inference)
    seconds = time.perf_counter() - start
    if args.output:
        write_output(args.output, "".join(line + "\n" for line in outputs).encode("utf-8"))
    return {"run_dir": str(args.run_dir), "data": [str(p) for p in args.data],
            "split": split,
            "split_by": "column" if has_split else ("none" if split == "all" else "hash"),
            "sentences": len(pairs),
            "beam": args.beam, "alpha": args.alpha,
            **score_translations(outputs, [p.target for p in pairs]),
            "seconds": round(seconds, 2)}
