"""Classification metrics: accuracy, per-class precision/recall/F1, macro-F1, confusion matrix.

Macro-F1 is the unweighted mean of per-class F1 over the classes that occur in the true or the
predicted labels (scikit-learn's ``f1_score(average="macro")``), so a class absent from both does not
count as a zero. A class's precision (recall) is 0 when it is never predicted (never true).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ClassificationReport:
    """Scores of predictions against true class indices.

    Attributes:
        labels: class names, in index order.
        confusion: (C, C) counts; row = true class, column = predicted class.
        accuracy / macro_f1: overall scores in [0, 1].
        precision / recall / f1 / support: per class (support = true rows of the class).
    """

    labels: tuple[str, ...]
    confusion: np.ndarray
    accuracy: float
    macro_f1: float
    precision: tuple[float, ...]
    recall: tuple[float, ...]
    f1: tuple[float, ...]
    support: tuple[int, ...]

    def to_dict(self) -> dict:
        return {"labels": list(self.labels), "confusion": self.confusion.tolist(),
                "accuracy": self.accuracy, "macro_f1": self.macro_f1,
                "per_class": {label: {"precision": p, "recall": r, "f1": f, "support": s}
                              for label, p, r, f, s in zip(self.labels, self.precision,
                                                           self.recall, self.f1, self.support)}}

    def confusion_table(self) -> str:
        """The confusion matrix as aligned text (rows: true, columns: predicted)."""
        names = list(self.labels)
        width = max(5, *(len(name) for name in names),
                    len(str(int(self.confusion.max(initial=0)))))
        header = "true\\pred".ljust(width) + " " + " ".join(name.rjust(width) for name in names)
        rows = [name.ljust(width) + " " + " ".join(str(int(v)).rjust(width) for v in row)
                for name, row in zip(names, self.confusion)]
        return "\n".join([header, *rows])

    def confusion_tsv(self) -> str:
        """The confusion matrix as TSV with a header row of predicted labels."""
        lines = ["true\\predicted\t" + "\t".join(self.labels)]
        lines += [name + "\t" + "\t".join(str(int(v)) for v in row)
                  for name, row in zip(self.labels, self.confusion)]
        return "\n".join(lines) + "\n"


def confusion_matrix(true: Sequence[int], predicted: Sequence[int], num_classes: int) -> np.ndarray:
    """(C, C) int64 counts, ``[t, p]`` = rows of true class t predicted as p.

    Raises:
        ValueError: different lengths or an index outside [0, num_classes).
    """
    true_array = np.asarray(true, dtype=np.int64)
    predicted_array = np.asarray(predicted, dtype=np.int64)
    if true_array.shape != predicted_array.shape or true_array.ndim != 1:
        raise ValueError(f"true and predicted must be equal-length sequences, got "
                         f"{true_array.shape} and {predicted_array.shape}")
    for name, array in (("true", true_array), ("predicted", predicted_array)):
        if array.size and (array.min() < 0 or array.max() >= num_classes):
            raise ValueError(f"{name} holds a class index outside [0, {num_classes})")
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (true_array, predicted_array), 1)
    return matrix


def classification_report(true: Sequence[int], predicted: Sequence[int],
                          labels: Sequence[str]) -> ClassificationReport:
    """Accuracy, macro-F1, per-class scores and the confusion matrix.

    Args:
        true / predicted: class indices, one per row.
        labels: class names (their number fixes C).

    Raises:
        ValueError: no rows, or see ``confusion_matrix``.
    """
    if len(true) == 0:
        raise ValueError("cannot score zero predictions")
    matrix = confusion_matrix(true, predicted, len(labels))
    hits = np.diag(matrix).astype(np.float64)
    predicted_count = matrix.sum(axis=0).astype(np.float64)
    true_count = matrix.sum(axis=1).astype(np.float64)
    precision = np.divide(hits, predicted_count, out=np.zeros_like(hits), where=predicted_count > 0)
    recall = np.divide(hits, true_count, out=np.zeros_like(hits), where=true_count > 0)
    denominator = precision + recall
    f1 = np.divide(2 * precision * recall, denominator, out=np.zeros_like(hits),
                   where=denominator > 0)
    present = (predicted_count > 0) | (true_count > 0)
    return ClassificationReport(
        labels=tuple(labels), confusion=matrix, accuracy=float(hits.sum() / matrix.sum()),
        macro_f1=float(f1[present].mean()), precision=tuple(precision.tolist()),
        recall=tuple(recall.tolist()), f1=tuple(f1.tolist()),
        support=tuple(int(v) for v in true_count))
