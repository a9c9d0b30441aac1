"""Encoder and decoder layers (paper 3.1) and the residual connection around each sub-layer.

Post-norm (the paper, 3.1 and 5.4):  x = LayerNorm(x + Dropout(Sublayer(x)))
Pre-norm  (GPT-2, "on layer normalization in the Transformer"):  x = x + Dropout(Sublayer(LayerNorm(x)))

Encoder layer: self-attention, FFN. Decoder layer: masked (causal) self-attention, cross-attention over
the encoder output (left out for decoder-only models), FFN. The stack hands every layer the rotation
of its positions (rotary positions), the position bias (T5) or the relative table (DeBERTa) it
computed once; self-attention uses them, cross-attention (between two sequences) does not.

Legend: B batch, T target/query length, S source/memory length, H heads, D model width.
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.nn.attention.cache import KVCache, MemoryCache
from aiayn.nn.attention.kernels import make_kernel
from aiayn.nn.attention.multihead import CrossAttention, SelfAttention
from aiayn.nn.disentangled import DisentangledTerms, RelativeTable, disentangled_spec
from aiayn.nn.feedforward import FeedForward, GatedFeedForward
from aiayn.nn.norms import layer_norm
from aiayn.nn.rotary import Rotation


class Residual(nn.Module):
    """The LayerNorm, dropout and residual sum around one sub-layer, in either order.

    A layer calls ``input(x)`` to get what the sub-layer reads and ``add(x, out)`` with what it wrote.
    With ``sandwich_norm`` (pre-norm only; Gemma 2 and 3) the sub-layer's output is normalised too,
    by a norm of its own, before the sum: x + Dropout(post_norm(Sublayer(norm(x)))).
    ``norm=False`` (pre-norm only): the sub-layer reads x as it is (ModernBERT's first attention,
    ``config.first_attention_norm``).
    """

    def __init__(self, config: TransformerConfig, *, norm: bool = True):
        super().__init__()
        self.norm = layer_norm(config) if norm else nn.Identity()
        self.post_norm = layer_norm(config) if config.sandwich_norm else None
        self.dropout = nn.Dropout(config.dropout)
        self.norm_first = config.norm_first

    def input(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_first else x

    def add(self, x: Tensor, out: Tensor) -> Tensor:
        if self.post_norm is not None:
            out = self.post_norm(out)
        out = x + self.dropout(out)
        return out if self.norm_first else self.norm(out)


def make_self_attention(config: TransformerConfig) -> SelfAttention:
    spec = disentangled_spec(config)
    terms = None if spec is None else DisentangledTerms(spec, config.d_model,
                                                        config.n_heads * config.head_dim)
    return SelfAttention(config.d_model, config.n_heads, make_kernel(config),
                         n_kv_heads=config.kv_heads, head_dim=config.head_dim,
                         fused_projections=config.fused_projections,
                         dropout=config.attention_dropout, bias=config.bias,
                         qkv_bias=config.qkv_bias, disentangled=terms, **qk_norms(config))


def make_cross_attention(config: TransformerConfig) -> CrossAttention:
    return CrossAttention(config.d_model, config.n_heads, make_kernel(config, cross=True),
                          n_kv_heads=config.kv_heads, head_dim=config.head_dim,
                          fused_projections=config.fused_projections,
                          dropout=config.attention_dropout, bias=config.bias,
                          qkv_bias=config.qkv_bias, **qk_norms(config))


def qk_norms(config: TransformerConfig) -> dict[str, nn.Module]:
    """QK-norm's two norms over the head width Dh (``qk_norm``), or none."""
    if not config.qk_norm:
        return {}
    return {"q_norm": layer_norm(config, config.head_dim),
            "k_norm": layer_norm(config, config.head_dim)}


def make_feedforward(config: TransformerConfig) -> FeedForward | GatedFeedForward:
    kind = GatedFeedForward if config.gated_ffn else FeedForward
    return kind(config.d_model, config.d_ff, activation=config.activation,
                dropout=config.activation_dropout, bias=config.bias)


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each wrapped in a Residual. ``first``: the stack's first layer,
    whose attention input is not normalised unless ``config.first_attention_norm``."""

    def __init__(self, config: TransformerConfig, *, first: bool = False):
        super().__init__()
        self.self_attention = make_self_attention(config)
        self.attention_residual = Residual(config, norm=config.first_attention_norm or not first)
        self.feedforward = make_feedforward(config)
        self.feedforward_residual = Residual(config)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, causal: bool = False,
                rotation: Rotation | None = None, position_bias: Tensor | None = None,
                relative: RelativeTable | None = None, band: int | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """x (B, T, D), mask broadcastable to (B, H, T, T); ``band`` W: each position attends only
        to the positions less than W away (a sliding layer). Returns (B, T, D) and the weights."""
        out, weights = self.self_attention(self.attention_residual.input(x), mask=mask,
                                           causal=causal, rotation=rotation,
                                           position_bias=position_bias, relative=relative,
                                           band=band, need_weights=need_weights)
        x = self.attention_residual.add(x, out)
        x = self.feedforward_residual.add(
            x, self.feedforward(self.feedforward_residual.input(x)))
        return x, weights


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention (unless decoder-only), FFN; each in a Residual.
    ``first``: as ``EncoderLayer``'s."""

    def __init__(self, config: TransformerConfig, *, cross_attention: bool = True,
                 first: bool = False):
        super().__init__()
        self.self_attention = make_self_attention(config)
        self.self_attention_residual = Residual(config,
                                                norm=config.first_attention_norm or not first)
        if cross_attention:
            self.cross_attention = make_cross_attention(config)
            self.cross_attention_residual = Residual(config)
        else:
            self.cross_attention = None
        self.feedforward = make_feedforward(config)
        self.feedforward_residual = Residual(config)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, self_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, cache: KVCache | None = None,
                memory_cache: MemoryCache | None = None, start: int | Tensor = 0,
                rotation: Rotation | None = None, position_bias: Tensor | None = None,
                band: int | None = None, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x (B, T, D), at positions ``start ..`` when decoding with this layer's ``cache``.

        ``self_mask`` (padding of the keys) broadcasts to (B, H, T, T_keys), the causal part is always
        added; ``memory_mask`` broadcasts to (B, H, T, S). ``rotation``, ``position_bias`` and
        ``band`` (a sliding window over the whole sequence) go to the self-attention. Returns
        (B, T, D), self- and cross-weights.
        """
        out, self_weights = self.self_attention(
            self.self_attention_residual.input(x), mask=self_mask, causal=True, cache=cache,
            start=start, rotation=rotation, position_bias=position_bias, band=band,
            need_weights=need_weights)
        x = self.self_attention_residual.add(x, out)
        cross_weights = None
        if self.cross_attention is not None:
            out, cross_weights = self.cross_attention(
                self.cross_attention_residual.input(x), memory, mask=memory_mask,
                cache=memory_cache, need_weights=need_weights)
            x = self.cross_attention_residual.add(x, out)
        x = self.feedforward_residual.add(
            x, self.feedforward(self.feedforward_residual.input(x)))
        return x, self_weights, cross_weights
