"""Memory-efficient exact attention: eq. 1 computed chunk by chunk with an online softmax.

softmax(Q K^T / sqrt(Dh)) V is computed over (query chunk, key chunk) tiles. Each query chunk keeps a
running maximum m, a running normaliser l and a running weighted sum of values; a new key tile rescales
them by exp(m_old - m_new) (the online softmax of Milakov & Gimelshein 2018, as in Rabe & Staats 2021
"Self-attention does not need O(n^2) memory" and FlashAttention, Dao et al. 2022). The backward pass
recomputes each tile from the saved log-sum-exp instead of storing the (T, S) weights, so forward and
backward both hold O(T * chunk) scores at a time and the result equals ``ReferenceAttention`` to float
rounding. The causal mask and a band (a sliding window of W) are applied per tile, never as a (T, S)
matrix, and the key tiles wholly outside them are skipped: under a band each query tile scores only
the keys within W - 1 of it, O(T * (chunk + 2 W)) work.

Legend: B batch, H heads, T query length, S key length, Dh head width, C chunk size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aiayn.nn.attention.kernels import AttentionKernel, refuse_position_bias, repeat_kv_heads


def _as_4d_mask(mask: Tensor | None, shape: tuple[int, int, int, int]) -> Tensor | None:
    """Check a boolean mask broadcastable to (B, H, T, S) and give it 4 dims (sizes 1 kept)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    if not 2 <= mask.dim() <= 4:
        raise ValueError(f"attention mask must have 2 to 4 dims broadcastable to (B, H, T, S), "
                         f"got shape {tuple(mask.shape)}")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    for size, want, name in zip(mask.shape, shape, "BHTS"):
        if size not in (1, want):
            raise ValueError(f"attention mask shape {tuple(mask.shape)} does not broadcast to "
                             f"(B, H, T, S) = {shape}: dim {name}")
    return mask


def _tile_mask(mask: Tensor | None, causal: bool, band: int | None, offset: int, q0: int, q1: int,
               k0: int, k1: int, device: torch.device) -> Tensor | None:
    """Allowed entries of the tile queries q0..q1-1 x keys k0..k1-1 (broadcastable), or None."""
    allowed = None
    if mask is not None:
        rows = slice(q0, q1) if mask.shape[2] > 1 else slice(None)
        cols = slice(k0, k1) if mask.shape[3] > 1 else slice(None)
        allowed = mask[:, :, rows, cols]
    # Right-aligned: query i sits at position offset + i. The causal part is needed only where the
    # tile's last key lies after its first query; the band's only where its corners are W apart.
    first, last = offset + q0, offset + q1 - 1
    needs_causal = causal and k1 - 1 > first
    needs_band = band is not None and max(last - k0, k1 - 1 - first) >= band
    if needs_causal or needs_band:
        distance = (torch.arange(first, last + 1, device=device)[:, None]
                    - torch.arange(k0, k1, device=device)[None, :])  # (Tc, Sc): query - key
        part = (distance >= 0) if needs_causal else None
        if needs_band:
            near = distance.abs() < band
            part = near if part is None else part & near
        allowed = part if allowed is None else allowed & part
    return allowed


def _key_tiles(causal: bool, band: int | None, offset: int, q0: int, q1: int, key_length: int,
               chunk_size: int) -> list[tuple[int, int]]:
    """The key tiles (k0, k1) the queries q0..q1-1 may attend to: keys after the last query's
    position are skipped under the causal mask, keys W or more from every query under a band."""
    start, end = 0, key_length
    if causal:
        end = min(end, offset + q1)
    if band is not None:
        start = max(0, offset + q0 - band + 1)
        end = min(end, offset + q1 - 1 + band)
    return [(k0, min(k0 + chunk_size, end)) for k0 in range(start, end, chunk_size)]


class _ChunkedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, causal, band, chunk_size, scale):
        batch, heads, query_length, head_dim = q.shape
        key_length = k.shape[2]
        offset = key_length - query_length
        out = torch.zeros_like(q)  # (B, H, T, Dh)
        lse = torch.zeros(batch, heads, query_length, 1, dtype=q.dtype, device=q.device)
        for q0 in range(0, query_length, chunk_size):
            q1 = min(q0 + chunk_size, query_length)
            q_tile = q[:, :, q0:q1] * scale  # (B, H, Tc, Dh)
            row_max = torch.full((batch, heads, q1 - q0, 1), -math.inf, dtype=q.dtype,
                                 device=q.device)
            row_sum = torch.zeros_like(row_max)  # (B, H, Tc, 1)
            acc = torch.zeros(batch, heads, q1 - q0, head_dim, dtype=q.dtype, device=q.device)
            for k0, k1 in _key_tiles(causal, band, offset, q0, q1, key_length, chunk_size):
                scores = q_tile @ k[:, :, k0:k1].transpose(-2, -1)  # (B, H, Tc, Sc)
                allowed = _tile_mask(mask, causal, band, offset, q0, q1, k0, k1, q.device)
                if allowed is not None:
                    scores = scores.masked_fill(~allowed, -math.inf)
                new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
                # A row with no allowed key yet has max -inf; shifting by 0 keeps exp() at 0, not NaN.
                shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                weights = torch.exp(scores - shift)  # (B, H, Tc, Sc), unnormalised
                rescale = torch.exp(row_max - shift)  # (B, H, Tc, 1): old terms to the new maximum
                row_sum = row_sum * rescale + weights.sum(dim=-1, keepdim=True)
                acc = acc * rescale + weights @ v[:, :, k0:k1]
                row_max = new_max
            has_key = row_sum > 0  # fully masked rows: output 0 (masks.py convention)
            out[:, :, q0:q1] = torch.where(has_key, acc / torch.where(has_key, row_sum, 1.0), 0.0)
            finite_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            lse[:, :, q0:q1] = torch.where(has_key, finite_max + torch.log(row_sum.clamp_min(
                torch.finfo(q.dtype).tiny)), 0.0)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        ctx.causal, ctx.band, ctx.chunk_size = causal, band, chunk_size
        ctx.has_mask = mask is not None
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        causal, band, chunk_size, scale = ctx.causal, ctx.band, ctx.chunk_size, ctx.scale
        query_length, key_length = q.shape[2], k.shape[2]
        offset = key_length - query_length
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        # dS = P * (dP - rowsum(dO * O)) (FlashAttention backward); rowsum(dO * O) = rowsum(P * dP).
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
        for q0 in range(0, query_length, chunk_size):
            q1 = min(q0 + chunk_size, query_length)
            q_tile, grad_out_tile = q[:, :, q0:q1], grad_out[:, :, q0:q1]  # (B, H, Tc, Dh)
            for k0, k1 in _key_tiles(causal, band, offset, q0, q1, key_length, chunk_size):
                k_tile, v_tile = k[:, :, k0:k1], v[:, :, k0:k1]  # (B, H, Sc, Dh)
                scores = (q_tile * scale) @ k_tile.transpose(-2, -1)  # (B, H, Tc, Sc)
                allowed = _tile_mask(mask, causal, band, offset, q0, q1, k0, k1, q.device)
                if allowed is not None:
                    scores = scores.masked_fill(~allowed, -math.inf)
                weights = torch.exp(scores - lse[:, :, q0:q1])  # (B, H, Tc, Sc), normalised
                grad_v[:, :, k0:k1] += weights.transpose(-2, -1) @ grad_out_tile
                grad_weights = grad_out_tile @ v_tile.transpose(-2, -1)  # (B, H, Tc, Sc)
                grad_scores = weights * (grad_weights - delta[:, :, q0:q1]) * scale
                grad_q[:, :, q0:q1] += grad_scores @ k_tile
                grad_k[:, :, k0:k1] += grad_scores.transpose(-2, -1) @ q_tile
        return grad_q, grad_k, grad_v, None, None, None, None, None


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                      causal: bool = False, chunk_size: int = 256,
                      scale: float | None = None, band: int | None = None) -> Tensor:
    """Exact attention (B, H, T, Dh) in O(T * chunk_size) memory; see the module docstring.

    Args:
        q: queries (B, H, T, Dh); k, v: keys and values (B, Hkv, S, Dh), Hkv dividing H.
        mask: boolean, broadcastable to (B, H, T, S), True = may attend.
        causal: add the right-aligned causal mask (query i sits at position S - T + i).
        chunk_size: queries and keys per tile.
        scale: multiplies the scores; None: 1 / sqrt(Dh).
        band: W: each query attends only to the keys less than W positions away (self-attention,
            T = S; with ``causal``, the W - 1 before it and itself).

    Raises:
        ValueError: a non-boolean or non-broadcastable mask, T > S with ``causal``, bad chunk size,
            a band with T != S.
    """
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    batch, heads, query_length, _ = q.shape
    key_length = k.shape[2]
    if causal and query_length > key_length:
        raise ValueError(f"causal attention needs query_length <= key_length, got {query_length} > "
                         f"{key_length}")
    if band is not None and key_length <= band:
        band = None  # no key is W or more away
    if band is not None and query_length != key_length:
        raise ValueError(f"a band is a self-attention mask (T = S), got {query_length} queries "
                         f"and {key_length} keys")
    mask = _as_4d_mask(mask, (batch, heads, query_length, key_length))
    k, v = repeat_kv_heads(k, v, heads)  # (B, H, S, Dh)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _ChunkedAttentionFunction.apply(q, k, v, mask, causal, band, chunk_size, scale)


class ChunkedAttention(AttentionKernel):
    """Exact attention chunked over queries and keys (``attention="chunked"``).

    Args:
        chunk_size: queries and keys per tile (``config.attention_chunk_size``).
        scale: multiplies the scores; None: 1 / sqrt(Dh).
    """

    def __init__(self, chunk_size: int = 256, *, scale: float | None = None):
        super().__init__(scale)
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0,
                position_bias: Tensor | None = None, band: int | None = None) -> Tensor:
        refuse_position_bias(position_bias, "chunked")
        if dropout > 0:
            # The weights are never stored, so there is nothing to drop; the config rejects
            # attention_dropout > 0 with this kernel, this guards direct calls.
            raise ValueError("chunked attention does not support attention dropout (got "
                             f"dropout={dropout}); use attention='reference' or 'fused' for it")
        return chunked_attention(q, k, v, mask=mask, causal=causal, chunk_size=self.chunk_size,
                                 scale=self.scale, band=band)

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"
