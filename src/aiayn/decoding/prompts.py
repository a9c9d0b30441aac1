"""Token ids as ``generate`` takes them: one prompt or several, checked against the vocabulary.

Legend: B prompts, T prompt length.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import Tensor


def id_like(value: object) -> bool:
    """An integer token id: a Python or NumPy integer, or a 0-d integer tensor (not a bool)."""
    if isinstance(value, (bool, float)) or getattr(value, "dtype", None) in (torch.bool, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def prompt_rows(prompt_ids: Tensor | Sequence[Sequence[int]] | Sequence[int], vocab_size: int
                ) -> list[list[int]]:
    """The prompts as lists of Python ints: one prompt (a list of ids or a (T,) tensor) or several
    (lists of different lengths, or a (B, T) tensor).

    Raises:
        ValueError: no prompt, an empty prompt, something that is not a token id, or an id outside
            [0, vocab_size).
    """
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() not in (1, 2) or prompt_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"prompt_ids must be an integer (T,) or (B, T) tensor, got "
                             f"{prompt_ids.dtype} {tuple(prompt_ids.shape)}")
        rows = prompt_ids.tolist() if prompt_ids.dim() == 2 else [prompt_ids.tolist()]
    elif len(prompt_ids) and not any(isinstance(t, (list, tuple, range))
                                     or getattr(t, "ndim", 0) >= 1 for t in prompt_ids):
        rows = [list(prompt_ids)]  # one prompt of scalars
    else:
        try:
            rows = [list(row) for row in prompt_ids]
        except TypeError:
            raise ValueError("prompt_ids must be a list of token ids, a list of such lists, or an "
                             "integer tensor") from None
    if not rows:
        raise ValueError("no prompts given")
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {index} is empty; give at least one token (e.g. a newline "
                             f"or a start token)")
        not_ids = [t for t in row if not id_like(t)]
        if not_ids:
            raise ValueError(f"prompt {index} holds {not_ids[0]!r} ({type(not_ids[0]).__name__}), "
                             f"not an integer token id")
        rows[index] = row = [operator.index(t) for t in row]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} holds token id {bad[0]} outside the vocabulary "
                             f"[0, {vocab_size})")
    return rows
