"""Batching variable-length id sequences: length-bucketed, reproducible batches and right padding.

Sorting by length inside large shuffled pools keeps the padding small (fewer wasted positions, so
faster steps) while the pool shuffle keeps batches random from epoch to epoch.

Legend: B batch, T longest length in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import Tensor


def bucketed_batches(lengths: Sequence[int], *, batch_size: int, rng: random.Random | None = None,
                     pool_batches: int = 50) -> list[list[int]]:
    """Row indices grouped into batches of similar length.

    Args:
        lengths: length of each row.
        batch_size: rows per batch (the last batch of a pool may be smaller).
        rng: shuffles rows, pools and batches; None gives a fixed order (sorted by length), for
            evaluation.
        pool_batches: rows are sorted by length within pools of ``pool_batches * batch_size``.

    Raises:
        ValueError: ``batch_size`` < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    order = list(range(len(lengths)))
    if rng is None:
        order.sort(key=lambda i: lengths[i])
        return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(order)
    pool = max(1, pool_batches) * batch_size
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: lengths[i])
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids (B, T), padding_mask (B, T) bool, True = real token) of right-padded sequences.

    Raises:
        ValueError: no sequences, or an empty one.
    """
    if not sequences:
        raise ValueError("cannot pad zero sequences")
    longest = max(len(sequence) for sequence in sequences)
    if min(len(sequence) for sequence in sequences) == 0:
        raise ValueError("cannot batch an empty sequence")
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
        mask[row, :len(sequence)] = True
    return ids, mask
