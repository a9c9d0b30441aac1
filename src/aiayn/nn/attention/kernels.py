"""Scaled dot-product attention kernels (paper 3.2.1, eq. 1): softmax(Q K^T / sqrt(d_k)) V.

Every kernel takes the same arguments and returns the same thing, so models swap kernels by name:

    kernel(q, k, v, mask=None, causal=False, dropout=0.0) -> (B, H, T, Dh)

q (B, H, T, Dh), k and v (B, H, S, Dh); ``mask`` is a boolean attention mask broadcastable to
(B, H, T, S) with True = may attend (see aiayn.masks); ``causal`` adds the right-aligned causal mask
without the caller materialising it, so kernels that never build a (T, S) matrix can honour it. A query
row with nothing to attend to returns zeros.

Kernels also own their decoding state: ``new_cache`` makes it, ``decode`` consumes new keys and values.
The default is the static KV cache; a kernel with a recurrent state (linear attention) overrides both.

Legend: B batch, H heads, T query length, S key length, Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.nn.attention.cache import KVCache
from aiayn.masks import causal_mask

if TYPE_CHECKING:
    from aiayn.config import TransformerConfig


def combine_masks(mask: Tensor | None, causal: bool, query_length: int, key_length: int,
                  device: torch.device) -> Tensor | None:
    """One boolean mask (broadcastable to (B, H, T, S)) from an optional mask and the causal flag."""
    if causal and query_length > 1:  # a single query sits at the last position: it sees every key
        causal_part = causal_mask(query_length, key_length, device=device)  # (T, S)
        return causal_part if mask is None else mask & causal_part
    return mask


class AttentionKernel(nn.Module):
    """Interface of an attention kernel (see the module docstring)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0) -> Tensor:
        raise NotImplementedError

    def new_cache(self, batch: int, heads: int, max_length: int, head_dim: int, *,
                  device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        return KVCache(batch, heads, max_length, head_dim, device=device, dtype=dtype)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, start: int,
               mask: Tensor | None = None) -> Tensor:
        """Causal attention of T new queries at positions start.. over the cache plus T new keys."""
        keys, values = cache.write(start, k, v)  # (B, H, start + T, Dh)
        return self(q, keys, values, mask=mask, causal=True)


class ReferenceAttention(AttentionKernel):
    """Eq. 1 written out; the only kernel that can also return the attention weights."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0) -> Tensor:
        return self.with_weights(q, k, v, mask=mask, causal=causal, dropout=dropout)[0]

    def with_weights(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                     causal: bool = False, dropout: float = 0.0) -> tuple[Tensor, Tensor]:
        """Returns the output (B, H, T, Dh) and the weights (B, H, T, S) before dropout."""
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
        allowed = combine_masks(mask, causal, q.shape[-2], k.shape[-2], q.device)
        if allowed is None:
            weights = scores.softmax(dim=-1)
        else:
            # A finite fill keeps fully masked rows finite (uniform); multiplying by has_key zeroes them.
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)
            weights = scores.softmax(dim=-1) * has_key
        dropped = F.dropout(weights, p=dropout) if dropout > 0 else weights
        return dropped @ v, weights  # (B, H, T, Dh), (B, H, T, S)


class FusedAttention(AttentionKernel):
    """``F.scaled_dot_product_attention``: PyTorch's flash / memory-efficient / math kernels, chosen
    by PyTorch for the device, dtype and mask."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0) -> Tensor:
        query_length, key_length = q.shape[-2], k.shape[-2]
        if causal and mask is None and query_length == key_length:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        allowed = combine_masks(mask, causal, query_length, key_length, q.device)
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        # SDPA returns NaN for a row with no allowed key on some versions and backends: open such rows
        # to every key, then zero their output (and so their gradient).
        has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~has_key,
                                             dropout_p=dropout)
        return out * has_key


@dataclass(frozen=True)
class KernelSpec:
    """How to build a kernel from a config, and what it supports."""

    build: Callable[["TransformerConfig"], AttentionKernel]
    description: str
    # Cross-attention kernel when it must differ (a positional sparsity pattern means nothing between
    # two sequences); None: ``build``.
    build_cross: Callable[["TransformerConfig"], AttentionKernel] | None = None


def _chunked(config: "TransformerConfig") -> AttentionKernel:
    from aiayn.nn.attention.chunked import ChunkedAttention  # late: it imports this module

    return ChunkedAttention(config.attention_chunk_size)


def _linear(config: "TransformerConfig") -> AttentionKernel:
    from aiayn.nn.attention.linear import LinearAttention

    return LinearAttention(config.attention_chunk_size)


def _exact_cross(config: "TransformerConfig") -> AttentionKernel:
    """Cross-attention of the sparse kernel: exact, chunked (fused when weights need dropout)."""
    return _chunked(config) if config.attention_dropout == 0 else FusedAttention()


def _sparse(config: "TransformerConfig") -> AttentionKernel:
    from aiayn.nn.attention.sparse import SparseAttention

    return SparseAttention(config.attention_pattern, config.attention_window,
                           config.attention_stride, config.attention_stride_count)


KERNELS: dict[str, KernelSpec] = {
    "reference": KernelSpec(lambda config: ReferenceAttention(), "eq. 1 written out; returns weights"),
    "fused": KernelSpec(lambda config: FusedAttention(), "torch scaled_dot_product_attention"),
    "chunked": KernelSpec(_chunked, "exact, online softmax over query/key chunks, O(n * chunk) memory"),
    "linear": KernelSpec(_linear, "elu+1 linear attention (Katharopoulos 2020), O(n), O(1) decoding"),
    "sparse": KernelSpec(_sparse, "local/strided block-sparse attention (Child 2019); cross-attention "
                                  "is exact (chunked)", build_cross=_exact_cross),
}


def make_kernel(config: "TransformerConfig", *, cross: bool = False) -> AttentionKernel:
    """The kernel named by ``config.attention`` (its cross-attention variant if ``cross``)."""
    try:
        spec = KERNELS[config.attention]
    except KeyError:
        raise ValueError(f"unknown attention kernel {config.attention!r}; choose one of "
                         f"{sorted(KERNELS)}") from None
    if cross and spec.build_cross is not None:
        return spec.build_cross(config)
    return spec.build(config)
