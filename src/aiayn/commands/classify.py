"""``aiayn classify RUN_DIR [--text TEXT ...]``: label each text (or each stdin line) with a trained classifier.

Prints ``label<TAB>probability`` per input, in input order; ``--top K`` prints the K best labels
(``label<TAB>probability`` pairs separated by tabs). Stdin is read line by line and answered in batches,
or line by line when it is a terminal. An empty line or a line that is not UTF-8 is an error naming
the line. A text2text run trained on classification generates each label as ``aiayn evaluate``
does (its prefix before the text, beam 4); the probability is the model's probability of that
label text, and there is one label per text."""

from __future__ import annotations

import argparse
import sys

from aiayn.commands import DefaultsHelpFormatter, summary
from aiayn.commands.train import device_name, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "classify", help="label texts with a trained classification run",
        description=summary(__doc__),
        formatter_class=DefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run of 'aiayn train classification', "
                        "a run of 'aiayn train text2text' trained on classification, or a Hugging "
                        "Face BertForSequenceClassification checkpoint directory")
    parser.add_argument("--text", action="append", dest="texts", default=[], metavar="TEXT",
                        help="a text to classify (repeatable; default: stdin lines)")
    parser.add_argument("--top", type=positive_int, default=1, help="labels printed per text")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="stdin lines per batch")
    parser.add_argument("--beam", type=positive_int, default=4,
                        help="text2text runs: beam size of the label's generation (1: greedy)")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from aiayn.data.text_files import decode_lines
    from aiayn.tasks.checkpoints import directory_task

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if directory_task(args.run_dir) == "text2text":
        answer = _text_to_text_answers(args)
    else:
        answer = _classifier_answers(args)

    if args.texts:
        for number, text in enumerate(args.texts, start=1):
            if not text.strip():
                raise ValueError(f"text {number} is empty")
        answer(list(args.texts))
        return 0
    batch_size = 1 if sys.stdin.isatty() else args.batch_size
    pending: list[str] = []
    try:
        for number, line in decode_lines(sys.stdin.buffer, "stdin"):
            if not line.strip():
                raise ValueError(f"stdin:{number}: empty text")
            pending.append(line)
            if len(pending) >= batch_size:
                batch, pending = pending, []  # never again, whatever stops this batch
                answer(batch)
    except ValueError:  # the lines before a bad one are still answered, in order
        if pending:
            answer(pending)
        raise
    if pending:
        answer(pending)
    return 0


def _classifier_answers(args: argparse.Namespace):
    """texts -> printed lines, for a classification run or a BERT checkpoint."""
    from aiayn.tasks.checkpoints import load_model_dir
    from aiayn.tasks.classification import predict_probabilities

    classifier = load_model_dir(args.run_dir, task="classification")
    assets = classifier.assets
    classifier.model.to(args.device)
    top = min(args.top, len(assets.labels))

    def answer(texts: list[str]) -> None:
        ids = assets.tokenizer.encode(texts, max_length=assets.max_tokens)
        probabilities = predict_probabilities(classifier.model, ids, pad_id=assets.tokenizer.pad_id,
                                              device=args.device)
        values, indices = probabilities.topk(top, dim=-1)
        for row_values, row_indices in zip(values.tolist(), indices.tolist()):
            sys.stdout.write("\t".join(f"{assets.labels.name(i)}\t{p:.4f}"
                                       for p, i in zip(row_values, row_indices)) + "\n")
        sys.stdout.flush()

    return answer


def _text_to_text_answers(args: argparse.Namespace):
    """texts -> printed lines, for a text2text run trained on classification: the label text
    generated as ``aiayn evaluate`` generates it, and the model's probability of that text."""
    import math

    from aiayn.tasks.checkpoints import load_model_dir
    from aiayn.tasks.text_to_text import MAX_EXTRA, generate_ids, output_log_probs, run_prefix

    if args.top != 1:
        raise ValueError(f"--top {args.top}: a text2text run generates one label per text "
                         f"(--top needs a run of 'aiayn train classification')")
    loaded = load_model_dir(args.run_dir, task="text2text")
    tokenizer = loaded.assets.tokenizer
    prefix = run_prefix(loaded.assets.prefixes, "classification", args.run_dir)
    model = loaded.model.to(args.device)

    def answer(texts: list[str]) -> None:
        sources, outputs = generate_ids(model, tokenizer,
                                        [prefix + text for text in texts],
                                        beam_size=args.beam, max_extra=MAX_EXTRA["classification"],
                                        max_length=loaded.assets.max_length)
        for label, log_p in zip(tokenizer.decode(outputs), output_log_probs(model, sources, outputs)):
            sys.stdout.write(f"{label.strip()}\t{math.exp(log_p):.4f}\n")
        sys.stdout.flush()

    return answer
