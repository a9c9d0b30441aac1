"""A band of keys computed block by block: each query is scored against one slice of keys around its
block, never a (S, S) matrix.

Bidirectional (an encoder's sliding window, ModernBERT's local layers): query i may attend key j
iff |i - j| < W (``aiayn.masks.band_mask``). Causal (a decoder's sliding window, Mistral's and
Gemma's local layers, over a whole sequence): iff 0 <= i - j < W (``aiayn.masks.window_mask`` and
the causal mask). Queries are cut into blocks of b = W; block n's queries see only keys
n*b - (W - 1) .. n*b + b - 1 + (W - 1) (causal: .. n*b + b - 1), one contiguous slice of
L = b + 2 (W - 1) (causal: b + W - 1) keys. The batch's blocks become the batch of one masked
attention call, so the work is S * L scores per head instead of S * S.

No key or value is copied per block: the rows are laid out (B * N * b, H, Dh), padded by W - 1
rows at either end, and each block's slice is an overlapping view into them (``unfold``). A slice
of a row's first or last block reaches into the next or previous row of the batch; those keys are
masked by their positions, as are the keys past S and the padding.

Legend: B batch, H heads, Hkv key/value heads, S length, Dh head width, W window, b block length,
N blocks per row, G = B * N blocks, L keys per block.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Attend = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (q, k, v, mask) -> output


def banded_attention(attend: Attend, q: Tensor, k: Tensor, v: Tensor, keys_allowed: Tensor | None,
                     window: int, causal: bool = False) -> Tensor:
    """Attention of q (B, H, S, Dh) over k, v (B, Hkv, S, Dh) within the band |i - j| < ``window``
    (``causal``: 0 <= i - j < ``window``).

    ``keys_allowed`` (B, S) or None: the key padding. ``attend(q, k, v, mask)`` is the masked
    attention that runs on the blocks: q (G, H, b, Dh), k and v (G, Hkv, L, Dh) strided views, mask
    (G, 1, b, L), True = may attend; it returns (G, H, b, Dh), zeros for a query with no allowed
    key. Returns (B, H, S, Dh).
    """
    batch, heads, length, head_dim = q.shape
    block, reach = window, window - 1
    after = 0 if causal else reach  # keys a query may see after itself
    blocks = -(-length // block)  # N
    tail = blocks * block - length  # rows padded after each row's end
    groups = batch * blocks  # G
    span = block + reach + after  # L

    def rows(x: Tensor) -> Tensor:  # (B, h, S, Dh) -> (G * b, h, Dh), each row padded to N * b
        return F.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, tail)).reshape(groups * block, -1, head_dim)

    def slices(x: Tensor) -> Tensor:  # (B, h, S, Dh) -> (G, h, L, Dh), views of the padded rows
        padded = F.pad(rows(x), (0, 0, 0, 0, reach, after))  # (G * b + L - b, h, Dh)
        return padded.unfold(0, span, block).permute(0, 1, 3, 2)

    query_blocks = rows(q).view(groups, block, heads, head_dim).transpose(1, 2)  # (G, H, b, Dh)
    offsets = torch.arange(span, device=q.device)
    # Key t of block n sits at position n*b - (W - 1) + t of its row; query i at n*b + i.
    distance = torch.arange(block, device=q.device)[:, None] + reach - offsets  # (b, L)
    band = (distance >= 0) & (distance < window) if causal else distance.abs() < window  # (b, L)
    position = torch.arange(blocks, device=q.device)[:, None] * block - reach + offsets  # (N, L)
    in_row = ((position >= 0) & (position < length)).repeat(batch, 1)  # (G, L)
    if keys_allowed is not None:
        real = F.pad(keys_allowed, (0, tail), value=False).reshape(-1)  # (G * b,)
        in_row = in_row & F.pad(real, (reach, after), value=False).unfold(0, span, block)
    mask = band & in_row[:, None, None, :]  # (G, 1, b, L)
    out = attend(query_blocks, slices(k), slices(v), mask)  # (G, H, b, Dh)
    out = out.transpose(1, 2).reshape(batch, blocks * block, heads, head_dim)[:, :length]
    return out.transpose(1, 2)  # (B, H, S, Dh)
