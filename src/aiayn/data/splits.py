"""Stratified train/valid/test split: every class keeps its share in every part.

Used when a labelled file has no split column, by ``aiayn train classification``, ``aiayn evaluate``
and ``benchmarks/classification_tfidf_baseline.py`` alike, so all of them score the same test rows.
The split is a pure function of (labels, fractions, seed): Python's ``random.Random(seed)``, classes
in sorted order, no dependence on hash randomisation or the global RNG.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SplitIndices:
    """Row indices of each part, each in increasing (file) order."""

    train: tuple[int, ...]
    valid: tuple[int, ...]
    test: tuple[int, ...]

    def part(self, name: str) -> tuple[int, ...]:
        if name not in ("train", "valid", "test"):
            raise ValueError(f"unknown split {name!r} (expected train, valid or test)")
        return getattr(self, name)


def stratified_split(labels: Sequence[str], *, valid_fraction: float = 0.1,
                     test_fraction: float = 0.1, seed: int = 0,
                     keys: Sequence[Hashable] | None = None) -> SplitIndices:
    """Split row indices so that each class is divided in the given proportions.

    Per class of n rows, round(n * fraction) rows go to valid and to test (at least one each when
    the fraction is positive and the class has at least 3 rows), the rest to train; a class always
    keeps at least one training row. With ``keys`` (e.g. each row's text), rows of one key that
    the draw put in different parts all go to train: a held-out row repeated in training data is
    not held out. Rows of distinct keys split exactly as without ``keys``.

    Args:
        labels: the label of each row.
        valid_fraction / test_fraction: shares in [0, 1) with a sum below 1.
        seed: the shuffle seed (same seed, same labels -> same split).
        keys: one per row, or None.

    Raises:
        ValueError: bad fractions or no rows.
    """
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(f"valid_fraction + test_fraction must be below 1, got "
                         f"{valid_fraction + test_fraction!r}")
    if not labels:
        raise ValueError("cannot split zero rows")
    by_class: dict[str, list[int]] = {}
    for index, label in enumerate(labels):
        by_class.setdefault(label, []).append(index)
    rng = random.Random(seed)
    train: list[int] = []
    valid: list[int] = []
    test: list[int] = []
    for label in sorted(by_class):
        rows = by_class[label]
        rng.shuffle(rows)
        n = len(rows)
        n_test = _share(n, test_fraction)
        n_valid = _share(n, valid_fraction)
        while n_test + n_valid >= n and n_test + n_valid > 0:  # keep one training row
            if n_valid >= n_test and n_valid > 0:
                n_valid -= 1
            else:
                n_test -= 1
        test.extend(rows[:n_test])
        valid.extend(rows[n_test:n_test + n_valid])
        train.extend(rows[n_test + n_valid:])
    if keys is not None:
        if len(keys) != len(labels):
            raise ValueError(f"{len(keys)} keys for {len(labels)} rows")
        parts: dict[Hashable, set[int]] = {}
        for number, part in enumerate((train, valid, test)):
            for index in part:
                parts.setdefault(keys[index], set()).add(number)
        shared = {key for key, numbers in parts.items() if len(numbers) > 1}
        moved = [index for index in valid + test if keys[index] in shared]
        train += moved
        valid = [index for index in valid if keys[index] not in shared]
        test = [index for index in test if keys[index] not in shared]
    return SplitIndices(train=tuple(sorted(train)), valid=tuple(sorted(valid)),
                        test=tuple(sorted(test)))


def _share(n: int, fraction: float) -> int:
    if fraction <= 0.0:
        return 0
    count = int(n * fraction + 0.5)  # round half up, not Python's banker's rounding
    return max(count, 1) if n >= 3 else count
