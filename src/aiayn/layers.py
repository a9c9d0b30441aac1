"""Encoder and decoder layers (paper 3.1) and the residual connection around each sub-layer.

Post-norm (the paper, 3.1 and 5.4):  x = LayerNorm(x + Dropout(Sublayer(x)))
Pre-norm  (GPT-2, "on layer normalization in the Transformer"):  x = x + Dropout(Sublayer(LayerNorm(x)))

Encoder layer: self-attention, FFN. Decoder layer: masked (causal) self-attention, cross-attention over
the encoder output (left out for decoder-only models), FFN.

Legend: B batch, T target/query length, S source/memory length, H heads, D model width.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from aiayn.attention.cache import DecoderCache
from aiayn.attention.multihead import MultiHeadAttention
from aiayn.config import TransformerConfig
from aiayn.attention.kernels import make_kernel
from aiayn.feedforward import FeedForward
from aiayn.inference_linear import SMALL_ROWS, has_hooks
from aiayn.normalisation import apply_dropout, layer_norm
from aiayn.packed_sequences import PackedBatch


class Residual(nn.Module):
    """A sub-layer with its dropout, residual connection and LayerNorm, in either order."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm = layer_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.norm_first = config.norm_first

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor], *,
                overwrite: bool = False) -> Tensor:
        """``overwrite``: the sub-layer's output is a fresh tensor nothing else holds
        (``owns_output``), so the sum may be written into it instead of a new (B, T, D) buffer."""
        out = apply_dropout(self.dropout, sublayer(self.norm(x) if self.norm_first else x))
        if overwrite and out.shape == x.shape and out.dtype == x.dtype:
            out = out.add_(x)
        else:
            out = x + out
        return out if self.norm_first else self.norm(out)


def owns_output(sublayer: nn.Module, last: nn.Linear) -> bool:
    """Whether the caller may overwrite ``sublayer``'s output, whose last step is the product
    ``last``: no autograd to record it, and no forward hook (the sub-layer's, the product's or a
    global one) that could have kept a reference."""
    return not (torch.is_grad_enabled() or has_hooks(sublayer) or has_hooks(last))


def many_rows(x: Tensor) -> bool:
    """Whether x (…, D) has more rows than a decoding step: only there is a residual sum's new
    buffer worth the checks of ``owns_output`` (an encoder's (B, T, D) sums: 1-2 % of a forward,
    docs/performance.md, twelfth pass)."""
    return x.numel() > SMALL_ROWS * x.shape[-1]


def make_attention(config: TransformerConfig, *, cross: bool) -> MultiHeadAttention:
    return MultiHeadAttention(config.d_model, config.n_heads, make_kernel(config, cross=cross),
                              cross=cross,
                              fused_projections=config.fused_projections,
                              dropout=config.attention_dropout, bias=config.bias)


def make_feedforward(config: TransformerConfig) -> FeedForward:
    return FeedForward(config.d_model, config.d_ff, activation=config.activation,
                       dropout=config.activation_dropout, bias=config.bias)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each wrapped in a Residual."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.self_attention = make_attention(config, cross=False)
        self.attention_residual = Residual(config)
        self.feedforward = make_feedforward(config)
        self.feedforward_residual = Residual(config)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, causal: bool = False,
                need_weights: bool = False, packed: PackedBatch | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, D), mask broadcastable to (B, H, T, T). Returns (B, T, D) and the weights.

        ``packed``: x (1, N, D) holds the real tokens of a padded batch back to back
        (aiayn.packed_sequences); attention stays within each sequence.
        """
        weights = None
        attention, feedforward = self.self_attention, self.feedforward

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            out, weights = attention(h, mask=mask, causal=causal, need_weights=need_weights,
                                     packed=packed)
            return out

        many = many_rows(x)
        x = self.attention_residual(
            x, attend, overwrite=many and owns_output(attention, attention.out_proj))
        x = self.feedforward_residual(
            x, feedforward, overwrite=many and owns_output(feedforward, feedforward.linear2))
        return x, weights


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention (unless decoder-only), FFN; each in a Residual."""

    def __init__(self, config: TransformerConfig, *, cross_attention: bool = True):
        super().__init__()
        self.self_attention = make_attention(config, cross=False)
        self.self_attention_residual = Residual(config)
        if cross_attention:
            self.cross_attention = make_attention(config, cross=True)
            self.cross_attention_residual = Residual(config)
        else:
            self.cross_attention = None
        self.feedforward = make_feedforward(config)
        self.feedforward_residual = Residual(config)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, cache: DecoderCache | None = None,
                layer_index: int = 0, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, T, D) at positions ``cache.length ..`` when decoding with a cache.

        ``self_mask`` (padding of the keys) broadcasts to (B, H, T, T_keys), the causal part is always
        added; ``memory_mask`` broadcasts to (B, H, T, S). Returns (B, T, D), self- and cross-weights.
        """
        self_weights = cross_weights = None
        attention, cross_attention = self.self_attention, self.cross_attention
        feedforward = self.feedforward

        def attend_self(h: Tensor) -> Tensor:
            nonlocal self_weights
            out, self_weights = attention(h, mask=self_mask, causal=True, cache=cache,
                                          layer_index=layer_index, need_weights=need_weights)
            return out

        def attend_memory(h: Tensor) -> Tensor:
            nonlocal cross_weights
            out, cross_weights = cross_attention(h, memory, mask=memory_mask, cache=cache,
                                                 layer_index=layer_index,
                                                 need_weights=need_weights)
            return out

        many = many_rows(x)
        x = self.self_attention_residual(
            x, attend_self, overwrite=many and owns_output(attention, attention.out_proj))
        if cross_attention is not None:
            x = self.cross_attention_residual(
                x, attend_memory,
                overwrite=many and owns_output(cross_attention, cross_attention.out_proj))
        x = self.feedforward_residual(
            x, feedforward, overwrite=many and owns_output(feedforward, feedforward.linear2))
        return x, self_weights, cross_weights
