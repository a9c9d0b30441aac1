"""Translation (paper section 6.1): a parallel corpus to an encoder-decoder model.

CLI glue for ``aiayn train translation`` and ``aiayn evaluate`` on translation runs; the task itself
is ``aiayn.tasks.translation.TranslationTask``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

DEFAULT_PRESET = "mt-cpu"


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
    group.add_argument("--init", default=None, metavar="DIR",
                       help="fine-tune a pretrained model: an aiayn translation run or a Hugging "
                            "Face Marian / BART checkpoint directory (its tokenizer and vocabulary "
                            "are kept; --preset and --vocab-size are ignored, --set applies)")
    # The default preset trains in minutes on a laptop CPU; see docs/translation.md.
    parser.set_defaults(preset=DEFAULT_PRESET, steps=3000, warmup=400, lr_factor=0.5,
                        clip_norm=1.0, eval_every=500, save_every=500, best_metric="bleu",
                        best_mode="max", log_every=20)


def make_task(args: argparse.Namespace):
    from aiayn.commands.train import parse_overrides
    from aiayn.tasks.pretrained import load_pretrained_model
    from aiayn.tasks.translation import TranslationTask

    pretrained = None
    if args.init:
        pretrained = load_pretrained_model(args.init, "translation")
        pretrained.config = pretrained.config.replace(**parse_overrides(args.set))
    return TranslationTask(args.data, run_dir=args.out, vocab_size=args.vocab_size,
                           max_tokens=args.max_tokens, max_length=args.max_length,
                           max_ratio=args.max_ratio, label_smoothing=args.label_smoothing,
                           valid_bleu_sentences=args.valid_bleu_sentences, seed=args.seed,
                           device=args.device, pretrained=pretrained)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """BLEU/chrF of RUN_DIR's model on ``args.data`` (the ``--split`` rows if it has a split
    column, else every row)."""
    from pathlib import Path

    from aiayn.commands.engine import engine
    from aiayn.data.parallel import read_pairs, select_split
    from aiayn.tasks.translate import score_translations, translate_texts
    from aiayn.tasks.checkpoints import load_model_dir

    run = load_model_dir(args.run_dir, task="translation")
    pairs = read_pairs(args.data)
    has_split = any(pair.split is not None for pair in pairs)
    if has_split:
        pairs = select_split(pairs, args.split)
    if args.limit is not None:
        pairs = pairs[:args.limit]
    inference = engine(run.model.to(args.device), args)
    start = time.perf_counter()
    outputs = translate_texts(inference.model, run.assets, [p.source for p in pairs],
                              beam_size=args.beam, alpha=args.alpha, max_tokens=args.max_tokens,
                              step=inference.decoder_step)
    seconds = time.perf_counter() - start
    if args.output:
        Path(args.output).write_text("".join(line + "\n" for line in outputs), encoding="utf-8")
    return {"run_dir": str(args.run_dir), "data": [str(p) for p in args.data],
            "split": args.split if has_split else "all", "sentences": len(pairs),
            "beam": args.beam, "alpha": args.alpha,
            **score_translations(outputs, [p.target for p in pairs]),
            "seconds": round(seconds, 2)}
