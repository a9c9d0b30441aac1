"""TF-IDF + logistic regression on a labelled TSV, scored on the same test split as aiayn.

The split is ``aiayn.data.splits.stratified_split`` with the same fractions and seed that
``aiayn train classification`` uses by default (or the file's own split column), so the numbers sit
side by side with ``aiayn evaluate RUN_DIR --data TSV``. The regularisation strength C is chosen on
the validation split (as our runs pick their best checkpoint on it); test is touched once.

    python3 benchmarks/classification_tfidf_baseline.py [--data data/debian_sections_topical.tsv.gz]
        [--against RUN_DIR]

Prints the command, accuracy and macro-F1 of each C on valid, the test scores, and writes a JSON.
``--against RUN_DIR`` (an ``aiayn train classification`` run on the same data) also measures, on the
validation split only, how the two models' errors overlap: the rows each gets right alone, the rows
both get wrong, and the average of their class probabilities at a few weights -- an estimate of how
far combining what a bag of words and the run know could go, not a model aiayn ships.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from aiayn.data.labelled_tsv import read_labelled_tsv  # noqa: E402
from aiayn.data.labels import LabelMap  # noqa: E402
from aiayn.data.splits import stratified_split  # noqa: E402
from aiayn.tasks.classification_metrics import classification_report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "data" / "debian_sections_topical.tsv.gz"))
    parser.add_argument("--valid-fraction", type=float, default=0.1)
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--c", type=float, nargs="+", default=[1.0, 3.0, 10.0, 30.0, 100.0],
                        help="inverse regularisation strengths tried on valid")
    parser.add_argument("--json", default="benchmarks/results/classification_tfidf_baseline.json")
    parser.add_argument("--against", metavar="RUN_DIR",
                        help="a classification run: compare its validation errors with TF-IDF's")
    args = parser.parse_args(argv)

    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    command = "python3 " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    print(f"command: {command}")
    data = read_labelled_tsv(args.data)
    if data.splits is not None:
        train, valid, test = (data.split(name) for name in ("train", "valid", "test"))
    else:
        parts = stratified_split(data.labels, valid_fraction=args.valid_fraction,
                                 test_fraction=args.test_fraction, seed=args.split_seed)
        train, valid, test = (data.subset(list(parts.part(n))) for n in ("train", "valid", "test"))
    labels = LabelMap.from_labels(train.labels)
    print(f"data: {args.data}: {len(train)} train / {len(valid)} valid / {len(test)} test rows, "
          f"{len(labels)} classes")

    start = time.perf_counter()
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x_train = vectorizer.fit_transform(train.texts)
    x_valid, x_test = vectorizer.transform(valid.texts), vectorizer.transform(test.texts)
    y_train = [labels.index(label) for label in train.labels]
    y_valid = [labels.index(label) for label in valid.labels]
    y_test = [labels.index(label, where=f"{args.data}, line {line}")
              for label, line in zip(test.labels, test.lines)]
    best = None
    for c in args.c:
        model = LogisticRegression(C=c, max_iter=2000)
        model.fit(x_train, y_train)
        report = classification_report(y_valid, model.predict(x_valid).tolist(), labels.names)
        print(f"  C={c:g}: valid accuracy {report.accuracy:.4f}, macro-F1 {report.macro_f1:.4f}")
        if best is None or report.macro_f1 > best[1].macro_f1:
            best = (c, report, model)
    c, valid_report, model = best
    test_report = classification_report(y_test, model.predict(x_test).tolist(), labels.names)
    seconds = time.perf_counter() - start
    print(f"TF-IDF + logistic regression (C={c:g}, chosen on valid): test accuracy "
          f"{test_report.accuracy:.4f}, macro-F1 {test_report.macro_f1:.4f} "
          f"({len(test)} rows; fit + predict {seconds:.1f} s)")
    result = {"command": command, "data": args.data, "model": "tfidf(1-2 grams)+logreg", "C": c,
              "valid": {"accuracy": valid_report.accuracy, "macro_f1": valid_report.macro_f1},
              "test": {"accuracy": test_report.accuracy, "macro_f1": test_report.macro_f1,
                       "rows": len(test)},
              "split": {"valid_fraction": args.valid_fraction,
                        "test_fraction": args.test_fraction, "seed": args.split_seed},
              "seconds": seconds}
    if args.against:
        result["against"] = compare_on_valid(args.against, labels, valid, y_valid,
                                             model.predict_proba(x_valid))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


def compare_on_valid(run_dir: str, labels: LabelMap, valid, y_valid: list[int],
                     tfidf_probabilities: np.ndarray) -> dict:
    """Error overlap of a run and TF-IDF on the validation rows, and their probability averages."""
    from aiayn.tasks.classification import score
    from aiayn.training.run import load_run

    run = load_run(run_dir, task="classification")
    if list(run.assets.labels.names) != list(labels.names):
        raise ValueError(f"{run_dir}: its labels {list(run.assets.labels.names)} are not this "
                         f"data's {list(labels.names)}")
    report, run_probabilities = score(run.model, run.assets, valid)
    truth = np.asarray(y_valid)
    run_right = run_probabilities.numpy().argmax(1) == truth
    tfidf_right = tfidf_probabilities.argmax(1) == truth
    overlap = {"both_right": float(np.mean(run_right & tfidf_right)),
               "only_run": float(np.mean(run_right & ~tfidf_right)),
               "only_tfidf": float(np.mean(~run_right & tfidf_right)),
               "both_wrong": float(np.mean(~run_right & ~tfidf_right))}
    print(f"{run_dir} on valid: accuracy {report.accuracy:.4f}, macro-F1 {report.macro_f1:.4f}; "
          + ", ".join(f"{name.replace('_', ' ')} {value:.3f}" for name, value in overlap.items()))
    averages = {}
    for weight in (0.3, 0.5, 0.7):
        mixed = weight * run_probabilities.numpy() + (1 - weight) * tfidf_probabilities
        mixed_report = classification_report(y_valid, mixed.argmax(1).tolist(), labels.names)
        averages[str(weight)] = {"accuracy": mixed_report.accuracy,
                                 "macro_f1": mixed_report.macro_f1}
        print(f"  {weight:g} x run + {1 - weight:g} x TF-IDF probabilities: valid accuracy "
              f"{mixed_report.accuracy:.4f}, macro-F1 {mixed_report.macro_f1:.4f}")
    return {"run": run_dir, "valid": {"accuracy": report.accuracy, "macro_f1": report.macro_f1},
            "overlap": overlap, "probability_averages": averages}


if __name__ == "__main__":
    sys.exit(main())
