"""The k largest entries of long rows: the selection step of beam search and top-k sampling.

``torch.topk`` on CPU selects over every entry of a row: 120-190 us a step for the (4, 4 x 8192)
candidates of a 4-beam search over 8192 words, 839 us over Marian's 58101 (AMD EPYC, 2 threads). When
k is small against the row there is a cheaper exact way. Cut the row into blocks; the k largest
entries lie in the k blocks with the largest maxima, since an entry of any other block is beaten by
those k maxima, each in a block of its own. So ``top_k`` takes every block's maximum (one vectorised
pass over the row), ranks those maxima, and selects among the k * BLOCK entries of the chosen blocks
and the row's tail past the last whole block. Measured (Zen 4 without AVX-512, 2 threads): the two
rows above in 72-86 us and 185 us; whole beam searches of 4 sources (d256, 3 + 3 layers;
``python3 benchmarks/fast_path_ab.py beam-topk`` at V 8192, a scratch run at larger V) 0.996-1.017x
at V 8192, 1.09-1.11x at V 32000, 1.08-1.10x at V 58101.

The values are exactly ``torch.topk``'s, largest first; so are the indices, except among equal values,
whose order ``torch.topk`` does not define either. NaN ranks above everything, as in ``torch.topk``.

Legend: R rows, N row length, k entries kept, M = N // BLOCK whole blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 128
# Shorter rows go to torch.topk: the dozen small operators below cost ~40 us whatever the row, more
# than torch.topk spends on one row of 8192 (21 us).
MIN_LENGTH = 16384
# Rows with fewer than MIN_BLOCKS_PER_K * k whole blocks go to torch.topk too: there the chosen blocks
# are a large part of the row ((8, 8192) with k = 50, 64 blocks: 239 us against torch.topk's 113).
MIN_BLOCKS_PER_K = 8


def uses_blocks(length: int, k: int, device: torch.device) -> bool:
    """Whether ``top_k`` selects through block maxima for rows of ``length`` (CPU only: on a GPU
    ``torch.topk`` is one parallel kernel already)."""
    return (device.type == "cpu" and length >= MIN_LENGTH
            and length // BLOCK >= MIN_BLOCKS_PER_K * k)


def top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk(x, k, dim=-1)``: the k largest entries of each row, largest first.

    Args:
        x: (..., N) scores.
        k: how many to keep, 1 <= k <= N.

    Returns:
        values (..., k) and their indices (..., k) into the last dimension.

    Raises:
        ValueError: k outside 1..N.
    """
    length = x.shape[-1]
    if not 1 <= k <= length:
        raise ValueError(f"k must be between 1 and the row length {length}, got {k}")
    if not uses_blocks(length, k, x.device):
        return torch.topk(x, k, dim=-1)
    lead = x.shape[:-1]
    rows = x.reshape(-1, length)  # (R, N)
    count = rows.shape[0]
    whole = length // BLOCK * BLOCK
    blocks = rows[:, :whole].unflatten(1, (whole // BLOCK, BLOCK))  # (R, M, BLOCK)
    chosen = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (R, k) blocks holding the k largest
    pool = blocks.gather(1, chosen.unsqueeze(-1).expand(count, k, BLOCK))  # (R, k, BLOCK)
    # where each pooled entry sits in the row
    where = (chosen.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=x.device))  # (R, k, BLOCK)
    pool, where = pool.view(count, k * BLOCK), where.view(count, k * BLOCK)
    if whole < length:  # the tail past the last whole block is always in the running
        pool = torch.cat([pool, rows[:, whole:]], dim=1)  # (R, k * BLOCK + N - whole)
        tail = torch.arange(whole, length, device=x.device).expand(count, length - whole)
        where = torch.cat([where, tail], dim=1)
    values, position = pool.topk(k, dim=-1)  # (R, k)
    return values.view(*lead, k), where.gather(1, position).view(*lead, k)
