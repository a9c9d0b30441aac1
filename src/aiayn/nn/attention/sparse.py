"""Sparse attention (Child et al. 2019, "Generating long sequences with sparse transformers"), computed
block-sparsely: only the allowed (query, key) pairs are ever scored.

Patterns (query at position p, key at position j; causal additionally needs j <= p):

    local           |p - j| < window                 (their A^(1) of the strided pattern, eq. 3.2)
    strided         (p - j) mod stride == 0          (their A^(2))
    local+strided   the union, in one softmax        (one head attending both, their "merged" form)

With ``stride_count`` = c the strided keys are bounded to |p - j| <= c * stride: c keys back (and c
forward when not causal) plus the query's own position, a dilated sliding window (Beltagy et al. 2020,
Longformer). Child's unbounded strided pattern gives each query n / stride keys, so for a fixed stride
it costs O(n^2 / stride) whatever the implementation; the bounded one costs O(n * c).

How the pairs are gathered without a (T, S) matrix:

* local: queries are cut into blocks of b = min(window, T); block n needs only the keys within the
  window of its first and last query, one contiguous slice of L = b + reach keys, taken with
  ``unfold`` from the padded keys. Scores are (B, H, T / b, b, L): O(T * window).
* strided: positions are laid out on a grid of ``stride`` columns (p = row * stride + column); the
  keys of a query are exactly the keys of its column, so scores are (B, H, stride, T/stride, S/stride):
  O(T * S / stride). For a fixed stride this part grows as n^2 / stride; Child et al. choose
  stride ~ sqrt(n) to make it O(n sqrt n). With the pattern 'local' the cost is O(n * window).
* bounded strided (``stride_count`` = c): on the same grid the keys of a query are the keys of its
  column at most c rows away, i.e. a local window of c + 1 rows along the column, so the local
  machinery runs on the transposed grid with the columns folded into the heads, in blocks of c rows:
  scores (B, H * stride, Aq / c, c, 2c [3c when not causal]), O(T * c), never (Aq, Ak). Columns of
  at most ``COLUMN_GRID_ROWS_PER_COUNT`` * c rows are cheaper scored whole (the (Aq, Ak) grid above,
  masked to the reach: still at most 4c scores per query). With at most ``stride`` queries (decoding)
  each query's c + 1 (causal) or 2c + 1 strided keys are gathered by index: (B, H, T, c + 1, Dh).
  When c * stride >= S - 1 every strided key is within reach: the unbounded path, the same pattern.

Scores of both parts are concatenated per query and normalised by one softmax; in 'local+strided' the
strided keys already inside the window are dropped so no key counts twice. Queries are right-aligned
(query i sits at position S - T + i), which is what decoding with a cache needs; masks may only be key
masks (B|1, H|1, 1, S). A query with no allowed key returns zeros.

Legend: B batch, H heads, T query length, S key length, Dh head width, b query block, L keys per
block, N blocks, l stride, Aq / Ak query / key grid rows.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.nn.attention.kernels import (AttentionKernel, refuse_band, refuse_position_bias,
                                        repeat_kv_heads)
from aiayn.nn.attention.linear import key_mask

SPARSE_PATTERNS = ("local", "strided", "local+strided")
# Bounded strided keys are scored by row windows along the grid's columns (2-3 x count scores per
# query, many small matmuls plus layout copies) once a column has more than this many times count
# rows; shorter columns are cheaper scored whole (the unbounded (Aq, Ak) grid, masked to the reach).
# On CPU (window = stride = 128, count 16) the two were about even at 4 x count rows (n = 8k).
COLUMN_GRID_ROWS_PER_COUNT = 4


def _check_options(pattern: str, window: int, stride: int, stride_count: int | None) -> None:
    if pattern not in SPARSE_PATTERNS:
        raise ValueError(f"pattern must be one of {list(SPARSE_PATTERNS)}, got {pattern!r}")
    for name, value in (("window", window), ("stride", stride), ("stride_count", stride_count)):
        if name == "stride_count" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer{' or None' * (name == 'stride_count')}"
                             f", got {value!r}")


def _local_part(q: Tensor, k: Tensor, keys_allowed: Tensor | None, window: int, causal: bool,
                min_distance: int = 0, block_views: bool = False, block: int | None = None
                ) -> tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    """Scores (B, H, T, L) and allowed (B|1, H|1, T, L) of the local window, plus a function
    mapping weights (B, H, T, L) and values (B, H, S, Dh) to the output (B, H, T, Dh).

    Keys closer than ``min_distance`` are left out (the bounded strided part, which runs this on the
    stride grid, leaves the rows inside the local window to the local part). ``block_views`` builds
    the key slices by concatenating P whole key blocks instead of ``unfold``: the same values, and a
    backward of slices and adds instead of ``unfold_backward``'s scatter (several times slower on CPU
    for the bounded strided part's many short slices). ``block``: queries per block (default: the
    window)."""
    batch, heads, query_length, _ = q.shape
    key_length = k.shape[2]
    offset = key_length - query_length
    block = min(block or window, query_length)
    blocks = -(-query_length // block)
    left, right = window - 1, 0 if causal else window - 1
    span = block + left + right  # L: keys any query of a block may see
    tail = blocks * block - query_length + right  # keys padded after the end
    q_blocks = F.pad(q, (0, 0, 0, blocks * block - query_length)).view(
        batch, heads, blocks, block, -1)  # (B, H, N, b, Dh)

    parts = -(-span // block)  # P: whole blocks covering one key slice

    def windows(x: Tensor) -> Tensor:  # (B, H, S, Dh) -> (B, H, N, L, Dh), block n's key slice
        if not block_views:
            padded = F.pad(x, (0, 0, left, tail))[:, :, offset:]  # (B, H, N*b + left + right, Dh)
            return padded.unfold(2, span, block).transpose(-2, -1)  # (B, H, N, L, Dh)
        padded = F.pad(x, (0, 0, left, tail + parts * block - span))[:, :, offset:]
        padded = padded.view(*x.shape[:2], blocks + parts - 1, block, -1)  # (B, H, N + P - 1, b, Dh)
        slices = torch.cat([padded[:, :, j:j + blocks] for j in range(parts)], dim=3)  # (.., N, P*b, Dh)
        return slices if parts * block == span else slices[:, :, :, :span]  # (B, H, N, L, Dh)

    scores = q_blocks @ windows(k).transpose(-2, -1)  # (B, H, N, b, L)
    # Position arithmetic: query (n, i) sits at offset + n*b + i, key (n, t) at offset + n*b + t - left.
    i = torch.arange(block, device=q.device)[:, None]
    t = torch.arange(span, device=q.device)[None, :]
    distance = (i + left) - t  # (b, L): query position - key position
    allowed = (distance >= 0) if causal else torch.ones_like(distance, dtype=torch.bool)
    allowed = allowed & (distance.abs() < window)  # (b, L)
    if min_distance > 0:
        allowed = allowed & (distance.abs() >= min_distance)
    key_index = (offset + torch.arange(blocks, device=q.device)[:, None] * block
                 + torch.arange(span, device=q.device)[None, :] - left)  # (N, L)
    in_range = (key_index >= 0) & (key_index < key_length)  # (N, L)
    allowed = allowed[None, None, None] & in_range[None, None, :, None, :]  # (1, 1, N, b, L)
    if keys_allowed is not None:
        padded = F.pad(keys_allowed, (left, tail), value=False)[..., offset:]  # (B|1, H|1, ...)
        allowed = allowed & padded.unfold(-1, span, block)[..., None, :]  # (B|1, H|1, N, b, L)
    rows = blocks * block

    def to_queries(x: Tensor) -> Tensor:  # (.., N, b, L) -> (.., T, L)
        return x.reshape(*x.shape[:2], rows, span)[:, :, :query_length]

    def output(weights: Tensor, v: Tensor) -> Tensor:
        weights = F.pad(weights, (0, 0, 0, rows - query_length)).view(
            batch, heads, blocks, block, span)  # (B, H, N, b, L)
        return (weights @ windows(v)).reshape(batch, heads, rows, -1)[:, :, :query_length]

    return to_queries(scores), to_queries(allowed), output


def _strided_part(q: Tensor, k: Tensor, keys_allowed: Tensor | None, stride: int, causal: bool,
                  exclude_window: int, reach: int | None = None
                  ) -> tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    """Scores (B, H, T, Ak) and allowed (B|1, H|1, T, Ak) of the strided keys, plus the output map.

    Keys closer than ``exclude_window`` to the query are left out (the local part has them), keys
    farther than ``reach`` too (None: no bound)."""
    batch, heads, query_length, dim = q.shape
    key_length = k.shape[2]
    offset = key_length - query_length
    front = offset % stride  # the query grid starts at row offset // stride
    query_rows = -(-(front + query_length) // stride)  # Aq
    key_rows = -(-key_length // stride)  # Ak

    def query_grid(x: Tensor) -> Tensor:  # (B, H, T, X) -> (B, H, l, Aq, X)
        x = F.pad(x, (0, 0, front, query_rows * stride - front - query_length))
        return x.view(*x.shape[:2], query_rows, stride, x.shape[-1]).transpose(2, 3)

    def key_grid(x: Tensor) -> Tensor:  # (B, H, S, X) -> (B, H, l, Ak, X)
        x = F.pad(x, (0, 0, 0, key_rows * stride - key_length), value=False if x.dtype == torch.bool else 0.0)
        return x.view(*x.shape[:2], key_rows, stride, x.shape[-1]).transpose(2, 3)

    def to_queries(x: Tensor) -> Tensor:  # (.., l, Aq, Ak) -> (.., T, Ak)
        x = x.transpose(2, 3).reshape(*x.shape[:2], query_rows * stride, x.shape[-1])
        return x[:, :, front:front + query_length]

    scores = query_grid(q) @ key_grid(k).transpose(-2, -1)  # (B, H, l, Aq, Ak)
    # Query row a and key row a' of one column are (offset // stride + a - a') * stride apart.
    rows = torch.arange(query_rows, device=q.device)[:, None] + offset // stride
    distance = (rows - torch.arange(key_rows, device=q.device)[None, :]) * stride  # (Aq, Ak)
    allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
    allowed = allowed & (distance.abs() >= exclude_window)  # (Aq, Ak)
    if reach is not None:
        allowed = allowed & (distance.abs() <= reach)
    column = torch.arange(stride, device=q.device)[:, None]
    in_range = (torch.arange(key_rows, device=q.device)[None, :] * stride + column) < key_length
    allowed = allowed[None] & in_range[:, None, :]  # (l, Aq, Ak)
    allowed = allowed[None, None]  # (1, 1, l, Aq, Ak)
    if keys_allowed is not None:
        grid = key_grid(keys_allowed[..., None])[..., 0]  # (B|1, H|1, l, Ak)
        allowed = allowed & grid[:, :, :, None, :]  # (B|1, H|1, l, Aq, Ak)

    def output(weights: Tensor, v: Tensor) -> Tensor:
        weights = F.pad(weights, (0, 0, front, query_rows * stride - front - query_length))
        weights = weights.view(batch, heads, query_rows, stride, key_rows).transpose(2, 3)
        out = weights @ key_grid(v)  # (B, H, l, Aq, Dh)
        out = out.transpose(2, 3).reshape(batch, heads, query_rows * stride, -1)  # (B, H, Aq*l, Dh)
        return out[:, :, front:front + query_length]

    return to_queries(scores), to_queries(allowed), output


def _bounded_strided_part(q: Tensor, k: Tensor, keys_allowed: Tensor | None, stride: int,
                          count: int, causal: bool, exclude_window: int
                          ) -> tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    """Scores (B, H, T, L) and allowed (B|1, H|1, T, L) of the strided keys at most ``count`` strides
    away, plus the output map.

    On the grid of ``stride`` columns (p = row * stride + column) a query's strided keys are the keys of
    its own column, and bounding them to ``count`` strides makes them a local window of ``count + 1``
    rows along that column: ``_local_part`` on the transposed grid, the columns folded into the heads
    (B, H * l, rows, Dh). Cost O(T * count); no (Aq, Ak) matrix is formed. Keys closer than
    ``exclude_window`` to the query are left out (the local part has them)."""
    query_length, key_length = q.shape[2], k.shape[2]
    front = (key_length - query_length) % stride  # the query grid starts at column `front`
    query_rows = -(-(front + query_length) // stride)  # Aq; the last query row is the last key row

    def grid(x: Tensor, before: int) -> Tensor:  # (B, H, n, X) -> (B, H * l, rows, X)
        length = x.shape[2]
        rows = -(-(before + length) // stride)
        if before or rows * stride > length:  # F.pad copies even when there is nothing to pad
            x = F.pad(x, (0, 0, before, rows * stride - before - length),
                      value=False if x.dtype == torch.bool else 0.0)  # (B, H, rows * l, X)
        x = x.view(*x.shape[:2], rows, stride, x.shape[-1]).transpose(2, 3)  # (B, H, l, rows, X)
        return x.reshape(x.shape[0], x.shape[1] * stride, rows, x.shape[-1])

    def to_queries(x: Tensor) -> Tensor:  # (B, H * l, Aq, X) -> (B, H, T, X)
        x = x.view(x.shape[0], -1, stride, query_rows, x.shape[-1]).transpose(2, 3)  # (B, H, Aq, l, X)
        x = x.reshape(x.shape[0], x.shape[1], query_rows * stride, x.shape[-1])
        return x[:, :, front:front + query_length]

    # Key mask on the grid (the grid's padding after the last key is not a key). Its columns fold
    # into its own head dim: (B|1, H|1 * l, Ak); a mask without heads stays without them, so the
    # allowed pattern comes back as (B|1, 1, T, L) and is never materialised per head.
    if keys_allowed is None:
        keys_allowed = torch.ones(1, 1, key_length, dtype=torch.bool, device=q.device)
    allowed_grid = grid(keys_allowed[..., None], 0)[..., 0]  # (B|1, H|1 * l, Ak)
    # Strided keys closer than exclude_window are those less than ceil(exclude_window / l) rows away.
    # Blocks of `count` rows: a block's key slice (count + count [+ count] rows) is exactly 2 (3) whole
    # blocks, so no slice is cut and no block padded when count divides the rows.
    scores, allowed, output = _local_part(grid(q, front), grid(k, 0), allowed_grid, count + 1, causal,
                                          min_distance=-(-exclude_window // stride), block_views=True,
                                          block=count)

    def output_map(weights: Tensor, v: Tensor) -> Tensor:
        weights = grid(weights, front)  # (B, H * l, Aq, L)
        return to_queries(output(weights, grid(v, 0)))  # (B, H, T, Dh)

    return to_queries(scores), to_queries(allowed), output_map


def _gathered_strided_part(q: Tensor, k: Tensor, keys_allowed: Tensor | None, stride: int,
                           count: int, causal: bool, exclude_window: int
                           ) -> tuple[Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    """The bounded strided part for a few queries (decoding): each query's M = count + 1 (causal) or
    2 count + 1 keys are gathered by index, (B, H, T, M, Dh). The grid form would score a whole grid row
    per column, ``stride`` times more than one new token needs."""
    query_length, key_length = q.shape[2], k.shape[2]
    steps = torch.arange(0 if causal else -count, count + 1, device=q.device)  # (M,) strides back
    position = torch.arange(key_length - query_length, key_length, device=q.device)[:, None]
    key_index = position - steps * stride  # (T, M)
    allowed = (key_index >= 0) & (key_index < key_length)
    allowed = allowed & ((steps * stride).abs() >= exclude_window)  # (T, M)
    key_index = key_index.clamp(0, key_length - 1)
    allowed = allowed[None, None]  # (1, 1, T, M)
    if keys_allowed is not None:
        allowed = allowed & keys_allowed[..., key_index]  # (B|1, H|1, T, M)
    scores = (q[..., None, :] @ k[:, :, key_index].transpose(-2, -1))[..., 0, :]  # (B, H, T, M)

    def output(weights: Tensor, v: Tensor) -> Tensor:  # (B, H, T, M) -> (B, H, T, Dh)
        return (weights[..., None, :] @ v[:, :, key_index])[..., 0, :]

    return scores, allowed, output


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                     causal: bool = False, dropout: float = 0.0, *, pattern: str = "local+strided",
                     window: int = 128, stride: int = 128, stride_count: int | None = None,
                     scale: float | None = None) -> Tensor:
    """Block-sparse attention (B, H, T, Dh); see the module docstring for the patterns.

    Args:
        q: queries (B, H, T, Dh), right-aligned with the keys; k, v: keys and values
            (B, Hkv, S, Dh), Hkv dividing H.
        mask: key mask broadcastable to (B, H, 1, S), True = may attend (e.g. padding).
        causal: only keys at or before the query's position.
        dropout: dropout on the sparse attention weights.
        pattern: 'local', 'strided' or 'local+strided'.
        window: keys within this distance (exclusive) are local.
        stride: strided keys are a multiple of ``stride`` away.
        stride_count: strided keys at most ``stride_count * stride`` away (back, and forward when not
            causal): a dilated sliding window, linear in n; None: all of them (Child et al.).
        scale: multiplies the scores; None: 1 / sqrt(Dh).

    Raises:
        ValueError: bad pattern/window/stride/stride_count, a per-query mask, or T > S.
    """
    _check_options(pattern, window, stride, stride_count)
    batch, heads, query_length, dim = q.shape
    key_length = k.shape[2]
    if query_length > key_length:
        raise ValueError(f"sparse attention aligns queries to the last keys and needs query_length "
                         f"<= key_length, got {query_length} > {key_length}")
    keys_allowed = key_mask(mask, batch, heads, query_length, key_length)  # (B|1, H|1, S)
    k, v = repeat_kv_heads(k, v, heads)  # (B, H, S, Dh)
    # Distances never exceed S - 1, so larger windows/strides mean the same pattern as S.
    window, stride = min(window, key_length), min(stride, key_length)
    parts = []
    if pattern in ("local", "local+strided"):
        parts.append(_local_part(q, k, keys_allowed, window, causal))
    if pattern in ("strided", "local+strided"):
        exclude = window if pattern == "local+strided" else 0
        if stride_count is None or stride_count * stride >= key_length - 1:
            # Every strided key is within reach: the unbounded pattern, whose Ak <= count + 1 keys
            # per query are no more than the bounded layouts' 2-3 x count.
            parts.append(_strided_part(q, k, keys_allowed, stride, causal, exclude))
        elif query_length <= stride:  # decoding: fewer queries than grid columns
            parts.append(_gathered_strided_part(q, k, keys_allowed, stride, stride_count, causal,
                                                exclude))
        elif -(-key_length // stride) <= COLUMN_GRID_ROWS_PER_COUNT * stride_count:
            # Short columns: whole columns in a few large matmuls, the rows beyond reach masked, cost
            # at most T * COLUMN_GRID_ROWS_PER_COUNT * count.
            parts.append(_strided_part(q, k, keys_allowed, stride, causal, exclude,
                                       reach=stride_count * stride))
        else:
            parts.append(_bounded_strided_part(q, k, keys_allowed, stride, stride_count, causal,
                                               exclude))
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    scores = torch.cat([part[0] for part in parts], dim=-1) * scale  # (B, H, T, L + Ak)
    mask_batch = max(part[1].shape[0] for part in parts)
    mask_heads = max(part[1].shape[1] for part in parts)
    allowed = torch.cat([part[1].expand(mask_batch, mask_heads, query_length, part[1].shape[-1])
                         for part in parts], dim=-1)  # (B|1, H|1, T, L + Ak)
    # As in ReferenceAttention: a finite fill keeps empty rows finite, has_key zeroes them.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)
    weights = scores.softmax(dim=-1) * has_key
    if dropout > 0:
        weights = F.dropout(weights, p=dropout)
    out, start = 0, 0
    for part in parts:
        width = part[0].shape[-1]
        out = out + part[2](weights[..., start:start + width], v)
        start += width
    return out


class SparseAttention(AttentionKernel):
    """Sparse attention of Child et al. 2019 (``attention="sparse"``).

    Decoding uses the static KV cache (the default ``decode``): the new queries attend, right-aligned
    and causally, over the cached keys through the same block-sparse forward. Per new token the local
    part scores ``window`` keys and the strided part one grid row per column (S keys) when unbounded,
    its ``stride_count + 1`` keys, gathered by index, when bounded (constant in the length).

    Args:
        pattern: 'local', 'strided' or 'local+strided' (``config.attention_pattern``).
        window: local window (``config.attention_window``).
        stride: stride of the strided pattern (``config.attention_stride``).
        stride_count: strided keys at most this many strides away, or None for all of them
            (``config.attention_stride_count``).
        scale: multiplies the scores; None: 1 / sqrt(Dh).

    Raises:
        ValueError: a bad pattern, window, stride or stride_count.
    """

    exact_softmax = False  # no softmax weights to draw (attention maps)

    def __init__(self, pattern: str = "local+strided", window: int = 128, stride: int = 128,
                 stride_count: int | None = None, *, scale: float | None = None):
        super().__init__(scale)
        _check_options(pattern, window, stride, stride_count)
        self.pattern, self.window, self.stride = pattern, window, stride
        self.stride_count = stride_count

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0,
                position_bias: Tensor | None = None, band: int | None = None) -> Tensor:
        refuse_position_bias(position_bias, "sparse")
        refuse_band(band, "sparse")
        return sparse_attention(q, k, v, mask=mask, causal=causal, dropout=dropout,
                                pattern=self.pattern, window=self.window, stride=self.stride,
                                stride_count=self.stride_count, scale=self.scale)

    def extra_repr(self) -> str:
        return (f"pattern={self.pattern!r}, window={self.window}, stride={self.stride}, "
                f"stride_count={self.stride_count}")
