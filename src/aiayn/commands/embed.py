"""``aiayn embed DIR``: sentence embeddings, one vector per input line (mean pooling, L2-normalised,
as sentence-transformers computes them), from a BERT checkpoint such as all-MiniLM-L6-v2 or an aiayn
classification / mlm run.

Writes one line of space-separated numbers per input line to stdout, or with ``--output X.npy`` an
(N, D) float32 NumPy array. An empty line or a line that is not UTF-8 is an error naming the line.
"""

from __future__ import annotations

import argparse
import sys

from aiayn.commands import DefaultsHelpFormatter, summary
from aiayn.commands.train import device_name, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "embed", help="sentence embeddings of stdin lines (or --input) with an encoder",
        description=summary(__doc__),
        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="DIR", help="a BERT checkpoint directory or an aiayn "
                        "classification / mlm run directory")
    parser.add_argument("--input", default=None, metavar="FILE",
                        help="texts, one a line (.gz allowed; default: stdin)")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="write here instead of stdout; a .npy name writes a NumPy array "
                             "(a file is replaced whole, a pipe or device written through)")
    parser.add_argument("--tokens-per-batch", type=positive_int, default=8192,
                        help="padded tokens per forward pass")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from aiayn.data.text_files import decode_lines, read_lines
    from aiayn.tasks.embeddings import embed_texts, load_embedder

    if args.threads:
        torch.set_num_threads(args.threads)
    embedder = load_embedder(args.run_dir)
    embedder.encoder.to(args.device)
    source = args.input or "stdin"
    lines = read_lines(args.input, what="text file") if args.input else \
        decode_lines(sys.stdin.buffer, "stdin")
    texts = []
    for number, line in lines:
        if not line.strip():
            raise ValueError(f"{source}:{number}: empty text")
        texts.append(line)
    if not texts:
        raise ValueError(f"{source}: no text to embed (the input is empty)")
    vectors = embed_texts(embedder, texts, tokens_per_batch=args.tokens_per_batch,
                          device=args.device)
    from aiayn.training.checkpoint import write_output

    if args.output and args.output.endswith(".npy"):  # written whole or not at all, as text is
        import io

        import numpy

        buffer = io.BytesIO()
        numpy.save(buffer, vectors.numpy())
        write_output(args.output, buffer.getvalue())
        print(f"wrote {args.output}: {tuple(vectors.shape)} float32", file=sys.stderr)
        return 0
    text = "".join(" ".join(f"{value:.7g}" for value in row) + "\n" for row in vectors.tolist())
    if args.output:
        write_output(args.output, text.encode("utf-8"))
    else:
        sys.stdout.write(text)
    return 0
