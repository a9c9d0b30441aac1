"""Language modelling on a plain text file (decoder-only; characters, a learned byte-level BPE or
a Hugging Face tokenizer) or on nanoGPT's prepared token files.

``aiayn train lm --data TEXT --out RUN_DIR``: the defaults of this sub-command are nanoGPT's CPU
"baby GPT" recipe (AdamW betas 0.9/0.99, weight decay 0.1 on matrices and embeddings only, 100
warm-up steps and cosine decay to 1e-4 over 2000 steps, clipping at 1.0, batch 12 of 64
characters) with the peak learning rate of the preset: ``--preset baby-gpt`` is nanoGPT's exact
recipe (lr 1e-3), the default ``char-gpt`` the same network at lr 3e-3, ``llama-char`` Llama's
decoder (rotary positions, RMSNorm, SwiGLU, grouped-query attention) at char-gpt's sizes and recipe
(docs/modern-decoder.md). ``--preset gpt2`` is GPT-2 small with nanoGPT's ``train_gpt2.py`` recipe
(``PRESET_RECIPES``). ``--tokenizer bpe`` / ``--tokenizer DIR`` trains on subword tokens
(``aiayn.tasks.lm``, docs/language-modelling.md). ``aiayn evaluate RUN_DIR --data TEXT`` reports
loss, perplexity and bits per character on a text (and bits per token for subwords).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


# Peak learning rate of each character-LM preset's recipe when --lr is not given. baby-gpt keeps
# nanoGPT's 1e-3 (the anchor); 3e-3 was the best of 1e-3..5e-3 for the same network on the bundled
# Shakespeare (docs/language-modelling.md, "A better default"); llama-char takes char-gpt's recipe
# unchanged, so the two differ only in the network.
PEAK_LR = {"baby-gpt": 1e-3, "char-gpt": 3e-3, "llama-char": 3e-3}
DEFAULT_LR = 1e-3
# The rest of the recipe, for the options not given: nanoGPT's CPU baby-GPT recipe, and for the
# gpt2 preset nanoGPT's config/train_gpt2.py (GPT-2 124M on OpenWebText: lr 6e-4, betas 0.9/0.95,
# 2000 warm-up steps, cosine to 6e-5 at 600,000, evaluation every 1,000).
RECIPE = dict(betas=(0.9, 0.99), warmup=100, min_lr=1e-4, steps=2000, eval_every=500,
              save_every=500)
PRESET_RECIPES = {"gpt2": dict(lr=6e-4, betas=(0.9, 0.95), warmup=2000, min_lr=6e-5,
                               steps=600_000, eval_every=1000, save_every=1000)}
DEFAULT_BPE_SIZE = 4096  # --tokenizer bpe without --vocab-size: the best of 512-8192 on the bundled
# Shakespeare (docs/language-modelling.md, "Subwords and corpora larger than memory")
# What `aiayn evaluate --split` can name for plain text, and what it scores when not given.
EVALUATION_SPLITS = ("all", "train", "valid")
EVALUATION_SPLIT = "all"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("language modelling data")
    group.add_argument("--data", required=True, metavar="TEXT",
                       help="UTF-8 text file (the first 90%% trains, the last 10%% validates), or a "
                            "directory of nanoGPT's train.bin + val.bin (needs --tokenizer DIR)")
    group.add_argument("--tokenizer", default=None, metavar="bpe|DIR",
                       help="the vocabulary: characters (default); 'bpe', a byte-level BPE of "
                            "--vocab-size entries learned on the training split; or a Hugging Face "
                            "tokenizer directory (tokenizer.json, e.g. GPT-2's). Subword ids are "
                            "written once to RUN_DIR/tokens and memory-mapped")
    group.add_argument("--vocab-size", type=int, default=None, metavar="N",
                       help="entries of the learned BPE vocabulary (with --tokenizer bpe; "
                            "default 4096)")
    group.add_argument("--batch-size", type=int, default=12, help="blocks per batch")
    group.add_argument("--block-size", type=int, default=None,
                       help="context length (default: the preset's max_length)")
    group.add_argument("--valid-fraction", type=float, default=0.1,
                       help="last fraction of the text held out for validation")
    group.add_argument("--batches-per-epoch", type=int, default=None,
                       help="random-offset batches per epoch (default: one pass over the text)")
    group.add_argument("--eval-batch-size", type=int, default=64, help="blocks per eval batch")
    group.add_argument("--init", default=None, metavar="DIR",
                       help="fine-tune a pretrained model: an aiayn lm run or a Hugging Face "
                            "GPT-2, Llama, Mistral, Qwen or Gemma checkpoint directory (its "
                            "tokenizer is kept; the model is the checkpoint's, --set applies, "
                            "--preset only picks the training recipe, so give a fine-tuning --lr; "
                            "the context is the checkpoint's unless --block-size)")
    # nanoGPT's shakespeare_char recipe with the CPU overrides of its README ("baby GPT"); the
    # options left None here come from the preset's recipe (preset_defaults).
    parser.set_defaults(preset="char-gpt", optimizer="adamw", adam_eps=1e-8, weight_decay=0.1,
                        decay_matrices_only=True, schedule="warmup_cosine", clip_norm=1.0,
                        log_every=10, **dict.fromkeys(["lr", *RECIPE], None))
    for action in parser._actions:
        if action.dest == "lr":
            action.help = ("peak learning rate; unset: the preset's ("
                           + ", ".join(f"{name} {lr:g}" for name, lr in PEAK_LR.items())
                           + f", gpt2 {PRESET_RECIPES['gpt2']['lr']:g}, others {DEFAULT_LR:g})")
        elif action.dest in RECIPE:
            value = RECIPE[action.dest]
            shown = " ".join(map(str, value)) if isinstance(value, tuple) else value
            action.help = (f"{action.help + '; ' if action.help else ''}unset: the preset's "
                           f"recipe ({shown}; gpt2: nanoGPT's train_gpt2.py, "
                           f"docs/language-modelling.md)")


def recipe(preset: str) -> dict[str, Any]:
    """The training options a preset's recipe gives where the command line gives none."""
    return {"lr": PEAK_LR.get(preset, DEFAULT_LR), **RECIPE, **PRESET_RECIPES.get(preset, {})}


def preset_defaults(args: argparse.Namespace) -> None:
    """Set the recipe options left unset (None) to the preset's (``aiayn.commands.train`` calls
    this before the task and the training config are made)."""
    from aiayn.commands.train import fill_unset

    fill_unset(args, recipe(args.preset))


def make_task(args: argparse.Namespace):
    preset_defaults(args)
    from aiayn.commands.train import parse_overrides
    from aiayn.tasks.lm import LanguageModelTask
    from aiayn.tasks.pretrained import load_pretrained_model

    if args.tokenizer == "bpe" and args.vocab_size is None:
        args.vocab_size = DEFAULT_BPE_SIZE
    pretrained = None
    if args.init:
        pretrained = load_pretrained_model(args.init, "lm")
        pretrained.config = pretrained.config.replace(**parse_overrides(args.set))
    return LanguageModelTask(args.data, batch_size=args.batch_size, block_size=args.block_size,
                             valid_fraction=args.valid_fraction,
                             batches_per_epoch=args.batches_per_epoch,
                             eval_batch_size=args.eval_batch_size, seed=args.seed,
                             device=args.device, pretrained=pretrained,
                             tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                             run_dir=args.out)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Loss, perplexity and bits per character of RUN_DIR's model on ``--data``: the whole file, or
    with ``--split valid`` / ``--split train`` its last ``valid_fraction`` / the rest, as the run
    split it in training. A directory of nanoGPT's token files: ``val.bin`` (``--split valid``, the
    default) or ``train.bin``, scored in bits per token."""
    import torch

    from aiayn.data.text import VALID_FRACTION, CharVocabulary, check_length
    from aiayn.data.chunked_encoding import encode_text
    from aiayn.data.token_files import TokenFiles, count_characters
    from aiayn.tasks.lm import batch_encoder, evaluate_ids, predicted_characters
    from aiayn.tasks.checkpoints import load_model_dir

    if args.split not in EVALUATION_SPLITS:
        raise ValueError(f"--split must be one of {', '.join(EVALUATION_SPLITS)} for a language "
                         f"model (plain text has no {args.split!r} split), got {args.split!r}")
    if len(args.data) != 1:
        raise ValueError(f"a language model is evaluated on one text file or token directory, "
                         f"got {len(args.data)} paths")
    run = load_model_dir(args.run_dir, task="lm")
    path = Path(args.data[0])
    device = torch.device(args.device)
    model = run.model.to(device)
    context = run.model_config.max_length
    if path.is_dir():
        if isinstance(run.assets, CharVocabulary):
            raise ValueError(f"{path} is a directory of token files; {args.run_dir} is a "
                             f"character model, which reads a text file")
        split = "valid" if args.split == "all" else args.split
        tokens = TokenFiles.open_nanogpt(path, vocab_size=len(run.assets))
        ids = tokens.valid if split == "valid" else tokens.train
        if args.limit is not None:
            ids = ids[:args.limit]
        check_length(ids, context, f"{split} part of {path}")
        metrics = evaluate_ids(model, ids, block_size=context, device=device, characters=0)
        return {"task": "lm", "data": str(path), "split": split, **metrics}
    # The part asked for, streamed through the vocabulary in the chunks training encoded its
    # splits in (the same ids), held in memory as uint16 / uint32
    total = count_characters(path)  # an empty text is an error here
    start, stop = 0, total
    if args.split != "all":  # older runs and checkpoints: aiayn train lm's default fraction
        fraction = (run.info.get("assets") or {}).get("valid_fraction", VALID_FRACTION)
        cut = int(total * (1.0 - fraction))
        start, stop = (0, cut) if args.split == "train" else (cut, total)
    if args.limit is not None:
        stop = min(stop, start + args.limit)
    vocabulary = run.assets
    ids, length = encode_text(path, encode_batch=batch_encoder(vocabulary),
                              vocab_size=len(vocabulary), start=start, stop=stop)
    check_length(ids, context,
                 str(path) if args.split == "all" else f"{args.split} part of {path}")
    characters = None  # characters: one token each
    if not isinstance(vocabulary, CharVocabulary):  # subwords: bits per character and per token
        characters = predicted_characters(vocabulary, ids, length)
    metrics = evaluate_ids(model, ids, block_size=context, device=device, characters=characters)
    return {"task": "lm", "data": str(path), "split": args.split, **metrics}
