"""Scaled dot-product attention kernels (paper 3.2.1, eq. 1): softmax(Q K^T / sqrt(d_k)) V.

Every kernel takes the same arguments and returns the same thing, so models swap kernels by name:

    kernel(q, k, v, mask=None, causal=False, dropout=0.0, position_bias=None, band=None)
        -> (B, H, T, Dh)

q (B, H, T, Dh), k and v (B, Hkv, S, Dh): Hkv = H, or fewer key/value heads each shared by a group of
H / Hkv consecutive query heads (grouped-query attention, Ainslie et al. 2023; multi-query at Hkv = 1,
Shazeer 2019). ``mask`` is a boolean attention mask broadcastable to (B, H, T, S) with True = may
attend (see aiayn.masks); ``causal`` adds the right-aligned causal mask without the caller
materialising it, so kernels that never build a (T, S) matrix can honour it; ``band`` W, likewise,
limits self-attention (T = S) to the keys less than W positions away on either side (an encoder's
sliding window, ``aiayn.masks.band_mask``; with ``causal``, a decoder's). ``position_bias`` is a
float tensor broadcastable to (B, H, T, S) added to the scores (T5's relative positions); kernels
that cannot add it refuse it. A query row with nothing to attend to returns zeros.

A kernel's ``scale`` multiplies the scores: None is the paper's 1 / sqrt(Dh); T5 uses 1.0,
Gemma 2 27B query_pre_attn_scalar^-1/2 (``TransformerConfig.attention_scale``).

Kernels also own their decoding state: ``new_cache`` makes it, ``decode`` consumes new keys and values.
The default is the static KV cache (a ring of W slots for a sliding-window layer); a kernel with a
recurrent state (linear attention) overrides both.

Legend: B batch, H heads, Hkv key/value heads, G = H / Hkv, T query length, S key length,
Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.nn.attention.banded import banded_attention
from aiayn.nn.attention.cache import KVCache, SlidingKVCache
from aiayn.masks import band_mask, causal_mask

if TYPE_CHECKING:
    from aiayn.config import TransformerConfig

# F.scaled_dot_product_attention groups key/value heads itself from torch 2.5 (``enable_gqa``);
# before, the fused kernel repeats them.
SDPA_GROUPS_HEADS = torch.__version__ >= (2, 5)


def repeat_kv_heads(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Keys and values (B, Hkv, S, Dh) -> (B, H, S, Dh), each key/value head repeated for its group
    of H / Hkv query heads (a no-op when Hkv = H)."""
    kv_heads = k.shape[1]
    if kv_heads == heads:
        return k, v
    if heads % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads must divide the {heads} query heads")
    group = heads // kv_heads
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, Dh)


def refuse_position_bias(position_bias: Tensor | None, kernel: str) -> None:
    """Kernels that never form the (T, S) scores cannot add a bias to them: a clear error."""
    if position_bias is not None:
        raise ValueError(f"{kernel} attention cannot add a position bias (T5's relative attention) "
                         f"to its scores; use attention='fused' or 'reference'")


def refuse_band(band: int | None, kernel: str) -> None:
    """Kernels that take key masks only cannot restrict each query to its band: a clear error."""
    if band is not None:
        raise ValueError(f"{kernel} attention cannot restrict each query to a band of keys (a "
                         f"sliding window); use attention='fused', 'reference' or 'chunked'")


def combine_masks(mask: Tensor | None, causal: bool, query_length: int, key_length: int,
                  device: torch.device, band: int | None = None) -> Tensor | None:
    """One boolean mask (broadcastable to (B, H, T, S)) from an optional mask, the causal flag and
    the band."""
    if causal and query_length > 1:  # a single query sits at the last position: it sees every key
        causal_part = causal_mask(query_length, key_length, device=device)  # (T, S)
        mask = causal_part if mask is None else mask & causal_part
    if band is not None and key_length > band:  # else no key is W or more away
        if query_length != key_length:
            raise ValueError(f"a band is a self-attention mask (T = S), got {query_length} queries "
                             f"and {key_length} keys")
        band_part = band_mask(key_length, band, device=device)  # (S, S)
        mask = band_part if mask is None else mask & band_part
    return mask


def key_padding(mask: Tensor | None, batch: int, key_length: int) -> tuple[bool, Tensor | None]:
    """Whether ``mask`` is None or a key mask (B|1, 1, 1, S), and then its (B, S) form (or None)."""
    if mask is None:
        return True, None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return False, None
    return True, mask[:, 0, 0, :].expand(batch, key_length)


class AttentionKernel(nn.Module):
    """Interface of an attention kernel (see the module docstring).

    Args:
        scale: multiplies the scores q . k; None: 1 / sqrt(Dh) (paper 3.2.1).

    ``exact_softmax``: whether the kernel computes softmax attention over every key the mask
    allows (eq. 1), so that the reference kernel's weights are its weights (attention maps).
    """

    exact_softmax = True

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def score_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0,
                position_bias: Tensor | None = None, band: int | None = None) -> Tensor:
        raise NotImplementedError

    def new_cache(self, batch: int, heads: int, max_length: int, head_dim: int, *,
                  window: int | None = None, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> KVCache:
        """The static KV cache of a layer; ``window`` W (a sliding-window layer) with room for
        more than W positions: a ring of W slots (``SlidingKVCache``)."""
        if window is not None and max_length > window:
            return SlidingKVCache(batch, heads, max_length, head_dim, window, device=device,
                                  dtype=dtype)
        return KVCache(batch, heads, max_length, head_dim, device=device, dtype=dtype)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, start: int,
               mask: Tensor | None = None, position_bias: Tensor | None = None,
               band: int | None = None) -> Tensor:
        """Causal attention of T new queries at positions start.. over the cache plus T new keys
        (``band``: a sliding window over a cache that was empty, start = 0)."""
        keys, values = cache.write(start, k, v)  # (B, Hkv, start + T, Dh)
        return self(q, keys, values, mask=mask, causal=True, position_bias=position_bias,
                    band=band)


class ReferenceAttention(AttentionKernel):
    """Eq. 1 written out; the only kernel that can also return the attention weights, and the only
    one that soft-caps the scores.

    Args:
        scale: as ``AttentionKernel``.
        softcap: None, or c: each scaled score s becomes c * tanh(s / c) before the mask (Gemma 2's
            ``attn_logit_softcapping``).
    """

    def __init__(self, scale: float | None = None, softcap: float | None = None):
        super().__init__(scale)
        self.softcap = softcap

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0,
                position_bias: Tensor | None = None, band: int | None = None) -> Tensor:
        return self.with_weights(q, k, v, mask=mask, causal=causal, dropout=dropout,
                                 position_bias=position_bias, band=band)[0]

    def with_weights(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                     causal: bool = False, dropout: float = 0.0,
                     position_bias: Tensor | None = None, band: int | None = None
                     ) -> tuple[Tensor, Tensor]:
        """Returns the output (B, H, T, Dh) and the weights (B, H, T, S) before dropout."""
        k, v = repeat_kv_heads(k, v, q.shape[1])  # (B, H, S, Dh)
        scores = q @ k.transpose(-2, -1) * self.score_scale(q.shape[-1])  # (B, H, T, S)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if position_bias is not None:
            scores = scores + position_bias
        allowed = combine_masks(mask, causal, q.shape[-2], k.shape[-2], q.device, band)
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
    by PyTorch for the device, dtype and mask.

    A ``band`` of W over more than 3 W positions, with at most a key mask, runs block by block
    (``aiayn.nn.attention.banded``): S * (3 W - 2) scores a head (causal: S * (2 W - 1)) instead of
    S * S, and no (S, S) mask. ModernBERT-base's encoder then runs 2.1x transformers' tokens/s at
    8,192 positions on a CPU (``benchmarks/modernbert_inference.py --length 8192 --batch 1``;
    level before).
    """

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0,
                position_bias: Tensor | None = None, band: int | None = None) -> Tensor:
        query_length, key_length = q.shape[-2], k.shape[-2]
        if (band is not None and key_length > 3 * band and query_length == key_length
                and position_bias is None):
            is_key_mask, keys_allowed = key_padding(mask, q.shape[0], key_length)
            if is_key_mask:  # each block: this kernel under the block's mask, no band
                return banded_attention(partial(self, dropout=dropout), q, k, v, keys_allowed,
                                        band, causal)
        grouped = {}
        if k.shape[1] != q.shape[1]:  # fewer key/value heads: SDPA groups them, or we repeat them
            if SDPA_GROUPS_HEADS:
                grouped = {"enable_gqa": True}
            else:
                k, v = repeat_kv_heads(k, v, q.shape[1])  # (B, H, S, Dh)
        options = dict(dropout_p=dropout, scale=self.scale, **grouped)
        if (causal and mask is None and position_bias is None and band is None
                and query_length == key_length):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
        allowed = combine_masks(mask, causal, query_length, key_length, q.device, band)
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=position_bias, **options)
        # SDPA returns NaN for a row with no allowed key on some versions and backends: open such rows
        # to every key, then zero their output (and so their gradient).
        has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)
        attn_mask = allowed | ~has_key
        if position_bias is not None:  # one additive float mask: the bias, -inf where not allowed
            attn_mask = torch.where(attn_mask, position_bias, -math.inf)  # (B|1, H, T, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)
        return out * has_key


@dataclass(frozen=True)
class KernelSpec:
    """How to build a kernel from a config, and what it supports."""

    build: Callable[["TransformerConfig"], AttentionKernel]
    description: str
    # Cross-attention kernel when it must differ (a positional sparsity pattern means nothing between
    # two sequences); None: ``build``.
    build_cross: Callable[["TransformerConfig"], AttentionKernel] | None = None


def _scale(config: "TransformerConfig") -> float | None:
    """The kernels' score scale: ``attention_scale`` when set (Gemma 2 27B), else None
    (1 / sqrt(Dh), the paper) or 1.0 (T5's unscaled scores)."""
    if config.attention_scale is not None:
        return float(config.attention_scale)
    return None if config.scale_attention else 1.0


def _chunked(config: "TransformerConfig") -> AttentionKernel:
    from aiayn.nn.attention.chunked import ChunkedAttention  # late: it imports this module

    return ChunkedAttention(config.attention_chunk_size, scale=_scale(config))


def _linear(config: "TransformerConfig") -> AttentionKernel:
    from aiayn.nn.attention.linear import LinearAttention

    return LinearAttention(config.attention_chunk_size)


def _exact_cross(config: "TransformerConfig") -> AttentionKernel:
    """Cross-attention of the sparse kernel: exact, chunked (fused when weights need dropout)."""
    return _chunked(config) if config.attention_dropout == 0 else FusedAttention(_scale(config))


def _sparse(config: "TransformerConfig") -> AttentionKernel:
    from aiayn.nn.attention.sparse import SparseAttention

    return SparseAttention(config.attention_pattern, config.attention_window,
                           config.attention_stride, config.attention_stride_count,
                           scale=_scale(config))


KERNELS: dict[str, KernelSpec] = {
    "reference": KernelSpec(lambda config: ReferenceAttention(_scale(config),
                                                              config.attention_softcap),
                            "eq. 1 written out; returns weights"),
    "fused": KernelSpec(lambda config: FusedAttention(_scale(config)),
                        "torch scaled_dot_product_attention"),
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


def swap_exact_kernels(model: nn.Module, name: str) -> int:
    """Give every attention module of ``model`` whose kernel is "reference" or "fused" the kernel
    ``name`` (one of those two) with the same scale; returns how many were swapped.

    Both compute eq. 1 exactly, with the same masks and dropout, so the swap changes speed, not the
    model: e.g. a bf16 backward pass on the CPU runs faster through the written-out kernel, while
    inference is faster through the fused one. Kernels hold no parameters: the state dict is
    unchanged."""
    kinds = {"reference": ReferenceAttention, "fused": FusedAttention}
    if name not in kinds:
        raise ValueError(f"swap_exact_kernels swaps between 'reference' and 'fused', got {name!r}")
    swapped = 0
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if getattr(kernel, "softcap", None) is not None:
            raise ValueError("a soft-capped reference kernel computes other numbers than the "
                             "fused one: it cannot be swapped")
        if type(kernel) in kinds.values():
            module.kernel = kinds[name](kernel.scale)
            swapped += 1
    return swapped
