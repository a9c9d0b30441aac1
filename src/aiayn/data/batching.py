"""Batches by token count with length bucketing (paper 5.1: "sentence pairs were batched together by
approximate sequence length"; each batch ~25k source + 25k target tokens, here a parameter).

Legend: B sentences in a batch, S source length, T target length (with </s>).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TranslationBatch:
    """Padded tensors of one batch; ``targets`` are the decoder inputs shifted left by one."""

    source: Tensor  # (B, S) ids, </s>-terminated, right-padded
    decoder_input: Tensor  # (B, T) <s> y1 .. yn
    targets: Tensor  # (B, T) y1 .. yn </s>, pad where there is no token
    target_tokens: int  # real target tokens (loss units), known on the CPU
    source_tokens: int
    index: Tensor  # (B,) positions of the sentences in the dataset

    def to(self, device) -> "TranslationBatch":
        if str(device) == "cpu":
            return self
        return TranslationBatch(self.source.to(device, non_blocking=True),
                                self.decoder_input.to(device, non_blocking=True),
                                self.targets.to(device, non_blocking=True), self.target_tokens,
                                self.source_tokens, self.index)


def token_batches(source_lengths: Sequence[int], target_lengths: Sequence[int], *,
                  max_tokens: int, shuffle: bool, seed: int = 0) -> list[list[int]]:
    """Group sentence indices into batches of at most ``max_tokens`` padded tokens per side.

    Sentences are sorted by (target, source) length so a batch pads little; with ``shuffle``, equal
    lengths are ordered randomly and the batch order is shuffled (deterministically from ``seed``).
    A sentence longer than ``max_tokens`` gets a batch of its own.

    Raises:
        ValueError: lengths of different counts or a non-positive ``max_tokens``.
    """
    if len(source_lengths) != len(target_lengths):
        raise ValueError("source_lengths and target_lengths differ in length")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    rng = random.Random(seed)
    keys = [rng.random() if shuffle else 0.0 for _ in source_lengths]
    order = sorted(range(len(source_lengths)),
                   key=lambda i: (target_lengths[i], source_lengths[i], keys[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        length = max(source_lengths[index], target_lengths[index])
        if current and max(longest, length) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def collate(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]] | None,
            indices: Sequence[int], *, pad_id: int, bos_id: int, eos_id: int,
            source_suffix: Sequence[int] = ()) -> TranslationBatch:
    """Pad one batch: source + </s> (+ ``source_suffix``: mBART's source language code); decoder
    input <s> + target; targets target + </s>."""
    batch = len(sources)
    end = [eos_id, *source_suffix]
    source_length = max(len(s) for s in sources) + len(end)
    source = torch.full((batch, source_length), pad_id, dtype=torch.long)  # (B, S)
    for row, ids in enumerate(sources):
        source[row, :len(ids) + len(end)] = torch.tensor([*ids, *end], dtype=torch.long)
    source_tokens = sum(len(s) + len(end) for s in sources)
    if targets is None:
        empty = torch.empty((batch, 0), dtype=torch.long)
        return TranslationBatch(source, empty, empty, 0, source_tokens,
                                torch.tensor(list(indices), dtype=torch.long))
    target_length = max(len(t) for t in targets) + 1
    decoder_input = torch.full((batch, target_length), pad_id, dtype=torch.long)  # (B, T)
    output = torch.full((batch, target_length), pad_id, dtype=torch.long)  # (B, T)
    for row, ids in enumerate(targets):
        ids = torch.tensor(ids, dtype=torch.long)
        decoder_input[row, 0] = bos_id
        decoder_input[row, 1:len(ids) + 1] = ids
        output[row, :len(ids)] = ids
        output[row, len(ids)] = eos_id
    target_tokens = sum(len(t) + 1 for t in targets)
    return TranslationBatch(source, decoder_input, output, target_tokens, source_tokens,
                            torch.tensor(list(indices), dtype=torch.long))


def pair_batches(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], *,
                 max_tokens: int, shuffle: bool, seed: int, pad_id: int, bos_id: int, eos_id: int,
                 device: torch.device | str = "cpu", source_suffix: Sequence[int] = ()
                 ) -> Iterator[TranslationBatch]:
    """Source/target id pairs as padded ``TranslationBatch``es of about ``max_tokens`` tokens a side
    (``token_batches`` over the lengths with their </s>, then ``collate``), on ``device``."""
    end = 1 + len(source_suffix)
    for indices in token_batches([len(s) + end for s in sources], [len(t) + 1 for t in targets],
                                 max_tokens=max_tokens, shuffle=shuffle, seed=seed):
        yield collate([sources[i] for i in indices], [targets[i] for i in indices], indices,
                      pad_id=pad_id, bos_id=bos_id, eos_id=eos_id,
                      source_suffix=source_suffix).to(device)
