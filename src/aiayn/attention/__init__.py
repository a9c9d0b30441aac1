"""Attention: kernels (eq. 1), multi-head attention (3.2.2) and the decoding cache."""

from aiayn.attention.cache import DecoderCache, KVCache
from aiayn.attention.kernels import (KERNELS, AttentionKernel, FusedAttention, ReferenceAttention,
                                     make_kernel)
from aiayn.attention.multihead import MultiHeadAttention

__all__ = ["KERNELS", "AttentionKernel", "DecoderCache", "FusedAttention", "KVCache",
           "MultiHeadAttention", "ReferenceAttention", "make_kernel"]
