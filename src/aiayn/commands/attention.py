"""``aiayn attention``: heatmaps, a head zoom, per-head pattern metrics and an HTML report of a model."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "attention", help="draw and measure a model's attention on a text or an image",
        description="Run a trained model (a run directory from 'aiayn train', or a Hugging Face style "
                    "directory) on a text and write: a layer x head heatmap grid per attention kind "
                    "(encoder, decoder, and for translation the cross-attention source-target "
                    "alignment), a zoom of one head (its weights in the cells up to 40 tokens), "
                    "the pattern metrics of every head (metrics.json / metrics.csv) over the text "
                    "or a file of texts, and optionally a self-contained interactive HTML report. "
                    "For an image-classification run, --image / --test-image draw the [CLS] "
                    "token's attention over the image per head and as attention rollout.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory or model directory")
    texts = parser.add_mutually_exclusive_group(required=True)
    texts.add_argument("--text", help="the (source) text to show")
    texts.add_argument("--text-file", metavar="FILE",
                       help="one text per line (translation: SOURCE<TAB>TARGET allowed); the "
                            "pictures show the first, the metrics average over all")
    texts.add_argument("--image", metavar="FILE", help="an image file, for a ViT run")
    texts.add_argument("--test-image", type=int, metavar="N",
                       help="image N of a ViT run's held-out test split")
    parser.add_argument("--target", help="translation: the target text (default: the model's "
                                         "greedy translation)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--layer", type=int, help="layer of the zoomed head (default: last)")
    parser.add_argument("--head", type=int, help="head to zoom (default: 0)")
    parser.add_argument("--kind", choices=("encoder", "decoder", "cross"),
                        help="zoom only this attention kind (default: every kind)")
    parser.add_argument("--window", type=int, default=2,
                        help="half-width of the local window metric (default 2)")
    parser.add_argument("--max-texts", type=int, default=1000,
                        help="at most this many texts from --text-file (default 1000)")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="tokenizers JSON or SentencePiece .model to use instead of the run's")
    parser.add_argument("--src-lang", default=None, metavar="CODE",
                        help="a multilingual translation checkpoint's source language code (as "
                             "aiayn translate takes it; a fine-tuned run: its pair by default)")
    parser.add_argument("--tgt-lang", default=None, metavar="CODE",
                        help="its target language code")
    parser.add_argument("--dpi", type=int, default=110, help="image resolution (default 110)")
    parser.add_argument("--html", action="store_true",
                        help="also write attention.html (self-contained, interactive)")
    parser.set_defaults(run=run)


def read_texts(path: str | Path, limit: int) -> list[tuple[str, str | None]]:
    """(text, target or None) per non-blank line of ``path``, at most ``limit``.

    Raises:
        FileNotFoundError: no such file. ValueError: no texts, or more than one tab on a line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file not found: {path}")
    pairs = []
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            parts = line.split("\t")
            if len(parts) > 2:
                raise ValueError(f"{path}:{number}: expected TEXT or SOURCE<TAB>TARGET, got "
                                 f"{len(parts)} tab-separated fields")
            pairs.append((parts[0], parts[1] if len(parts) == 2 else None))
            if len(pairs) >= limit:
                break
    if not pairs:
        raise ValueError(f"{path}: no texts")
    return pairs


def run(args: argparse.Namespace) -> int:
    import sys

    from aiayn.visualise.attention_report import write_attention_report
    from aiayn.visualise.subjects import load_subject

    if args.image is not None or args.test_image is not None:
        from aiayn.commands.attention_image import run_image

        if args.src_lang is not None or args.tgt_lang is not None:
            raise ValueError("--src-lang / --tgt-lang go with a translation model's texts, not "
                             "with images")

        return run_image(args)
    if args.max_texts < 1:
        raise ValueError(f"--max-texts must be >= 1, got {args.max_texts}")
    subject = load_subject(args.run_dir, tokenizer_file=args.tokenizer, src_lang=args.src_lang,
                           tgt_lang=args.tgt_lang)
    for note in subject.missing:
        print(f"aiayn attention: note: {note}", file=sys.stderr)
    if args.text is not None:
        pairs = [(args.text, args.target)]
    else:
        pairs = read_texts(args.text_file, args.max_texts)
        if args.target is not None:
            raise ValueError("--target goes with --text; put targets in the file as "
                             "SOURCE<TAB>TARGET")
    examples = [subject.example(text, target) for text, target in pairs]
    if subject.encoder_decoder and pairs[0][1] is None:
        print(f"target (greedy translation): {' '.join(examples[0].target_tokens)}")
    written = write_attention_report(
        subject.model, examples, args.out, layer=args.layer, head=args.head, kind=args.kind,
        html=args.html, window=args.window, dpi=args.dpi,
        title=f"{Path(args.run_dir).name} ({subject.task})")
    for name, path in written.items():
        print(f"wrote {path}")
    print(f"{len(examples)} text(s); tokenizer: "
          f"{subject.tokenizer.description if subject.tokenizer else 'none (token ids)'}")
    return 0
