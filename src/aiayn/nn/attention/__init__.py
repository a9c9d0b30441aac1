"""Attention: kernels (eq. 1), multi-head self- and cross-attention (3.2.2), the decoding cache."""

from aiayn.nn.attention.cache import DecoderCache, KVCache, MemoryCache
from aiayn.nn.attention.kernels import (KERNELS, AttentionKernel, FusedAttention,
                                        ReferenceAttention, make_kernel)
from aiayn.nn.attention.multihead import CrossAttention, MultiHeadAttention, SelfAttention

__all__ = ["KERNELS", "AttentionKernel", "CrossAttention", "DecoderCache", "FusedAttention",
           "KVCache", "MemoryCache", "MultiHeadAttention", "ReferenceAttention", "SelfAttention",
           "make_kernel"]
