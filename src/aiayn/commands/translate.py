"""``aiayn translate RUN_DIR``: translate stdin to stdout, one sentence a line; RUN_DIR is a run of
``aiayn train translation``, a run of ``aiayn train text2text`` trained on translation (its task
prefix is put before each line), or a Hugging Face Marian / BART / T5 / mBART / M2M100 / NLLB checkpoint
directory (the multilingual ones with ``--src-lang`` and ``--tgt-lang``)."""

from __future__ import annotations

import argparse
import sys

from aiayn.commands import DefaultsHelpFormatter, engine
from aiayn.commands.train import device_name, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "translate", help="translate stdin to stdout with a trained translation run",
        description="Read sentences from stdin (one a line) and write their translations to "
                    "stdout in the same order, with beam search (paper 6.1: beam 4, alpha 0.6).",
        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory ('aiayn train "
                        "translation', or 'aiayn train text2text': its translation prefix is put "
                        "before each line) or a Hugging Face Marian / BART / T5 / mBART / M2M100 "
                        "/ NLLB checkpoint directory")
    add_language_arguments(parser)
    parser.add_argument("--beam", type=positive_int, default=4, help="beam size (1: greedy)")
    parser.add_argument("--alpha", type=float, default=0.6, help="GNMT length penalty exponent")
    parser.add_argument("--max-tokens", type=positive_int, default=4000,
                        help="tokens per decoding batch")
    parser.add_argument("--batch-lines", type=positive_int, default=256,
                        help="lines read before translating (bounds memory on long inputs); "
                             "at a terminal each line is translated as it is typed")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    engine.add_arguments(parser)
    parser.set_defaults(run=run)


def add_language_arguments(parser: argparse.ArgumentParser) -> None:
    """``--src-lang`` / ``--tgt-lang``: the language pair of a multilingual checkpoint."""
    parser.add_argument("--src-lang", default=None, metavar="CODE",
                        help="source language code of a multilingual checkpoint (NLLB eng_Latn, "
                             "M2M100 en, mBART en_XX): put in each source where its tokenizer "
                             "puts it; a run fine-tuned from one defaults to the pair it trained "
                             "on")
    parser.add_argument("--tgt-lang", default=None, metavar="CODE",
                        help="target language code of a multilingual checkpoint: forced as the "
                             "first generated token (transformers' forced_bos_token_id), or the "
                             "decoder's start symbol for mBART's own tokenizer")


def run(args: argparse.Namespace) -> int:
    import torch

    from aiayn.data.text_files import decode_lines
    from aiayn.tasks.checkpoints import directory_task, load_model_dir, set_languages
    from aiayn.tasks.text_to_text import run_prefix

    if args.threads:
        torch.set_num_threads(args.threads)
    prefix = ""
    if directory_task(args.run_dir) == "text2text":
        run_ = load_model_dir(args.run_dir, task="text2text")
        set_languages(run_, args.src_lang, args.tgt_lang)  # none: an error if given
        tokenizer = run_.assets.tokenizer
        prefix = run_prefix(run_.assets.prefixes, "translation", args.run_dir)
    else:
        run_ = load_model_dir(args.run_dir, task="translation")
        set_languages(run_, args.src_lang, args.tgt_lang)
        tokenizer = run_.assets
    inference = engine.engine(run_.model.to(args.device), args)
    batch = 1 if sys.stdin.isatty() else args.batch_lines  # a terminal: answer each line
    lines: list[str] = []
    try:
        # Bytes decoded line by line: a line that is not UTF-8 is an error naming it.
        for _, line in decode_lines(sys.stdin.buffer, "stdin"):
            lines.append(line)
            if len(lines) >= batch:
                pending, lines = lines, []  # never again, whatever stops this batch
                _flush(inference, tokenizer, prefix, pending, args)
    except ValueError:  # the lines before a bad one are still translated, in order
        if lines:
            _flush(inference, tokenizer, prefix, lines, args)
        raise
    if lines:
        _flush(inference, tokenizer, prefix, lines, args)
    return 0


def _flush(inference, tokenizer, prefix: str, lines: list[str], args) -> None:
    from aiayn.tasks.translate import translate_texts

    lines = [prefix + line if line.strip() else line for line in lines]  # empty stays empty
    for output in translate_texts(inference.model, tokenizer, lines, beam_size=args.beam,
                                  alpha=args.alpha, max_tokens=args.max_tokens,
                                  engine=inference):
        sys.stdout.write(output + "\n")
    sys.stdout.flush()
