"""Multi-head attention (paper 3.2.2): project, split into heads, attend, concatenate, project.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

The h per-head projections are one (D, D) matrix each for Q, K and V (or one fused (D, 3D) matrix for
self-attention, one (D, 2D) for the keys and values of cross-attention). The attention itself is a
kernel object (aiayn.attention.kernels), so reference / fused / efficient kernels are interchangeable.

Legend: B batch, T query length, S key length, H heads, D model width, Dh head width (D / H).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.attention import folded_cross
from aiayn.attention.cache import DecoderCache
from aiayn.attention.folded_cross import FoldedCrossAttention, fold
from aiayn.attention.kernels import AttentionKernel, ReferenceAttention
from aiayn.inference_linear import has_hooks, linear
from aiayn.packed_sequences import PackedBatch


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention with its input and output projections.

    Args:
        d_model: model width D.
        n_heads: number of heads H; must divide D.
        kernel: the attention kernel (e.g. ``FusedAttention()``).
        cross: True for encoder-decoder attention (queries from the decoder, keys/values from memory).
        fused_projections: one matmul for q, k, v (self) or k, v (cross) instead of separate ones.
        dropout: dropout on the attention weights (training only).
        bias: biases on the projections.
    """

    def __init__(self, d_model: int, n_heads: int, kernel: AttentionKernel, *, cross: bool = False,
                 fused_projections: bool = True, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.cross, self.fused_projections, self.dropout = cross, fused_projections, dropout
        self.kernel = kernel
        if fused_projections and not cross:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, d_model, bias=bias)
            if fused_projections:
                self.kv_proj = nn.Linear(d_model, 2 * d_model, bias=bias)
            else:
                self.k_proj = nn.Linear(d_model, d_model, bias=bias)
                self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

    def _project_query_key_value(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.fused_projections:
            # split + per-part view (as nanoGPT) rather than view(B, T, 3, H, Dh).permute.unbind:
            # the same strided views, but the backward of split is one cat into the (B, T, 3D)
            # gradient, where unbind's stack + permute needs a further copy before the matmul.
            q, k, v = linear(self.qkv_proj, x).split(self.d_model, dim=-1)  # 3 x (B, T, D)
            return self._heads(q), self._heads(k), self._heads(v)  # 3 x (B, H, T, Dh)
        return (self._heads(linear(self.q_proj, x)), self._heads(linear(self.k_proj, x)),
                self._heads(linear(self.v_proj, x)))

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, H, S, Dh) of cross-attention; computed once per source when decoding."""
        if self.fused_projections:
            k, v = linear(self.kv_proj, memory).split(self.d_model, dim=-1)  # 2 x (B, S, D)
            return self._heads(k), self._heads(v)  # 2 x (B, H, S, Dh)
        return self._heads(linear(self.k_proj, memory)), self._heads(linear(self.v_proj, memory))

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask: Tensor | None = None,
                causal: bool = False, cache: DecoderCache | None = None, layer_index: int = 0,
                need_weights: bool = False, packed: PackedBatch | None = None
                ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` (B, T, D) to itself, or to ``memory`` (B, S, D) for cross-attention.

        ``mask`` broadcasts to (B, H, T, S), True = may attend; ``causal`` adds a right-aligned causal
        mask. With a ``cache``, ``x`` holds the T newest positions, starting at ``cache.length``.
        ``packed``: x (1, N, D) is the real tokens of a padded batch back to back
        (aiayn.packed_sequences); each sequence attends to itself only (self-attention, no mask or
        cache), and the weights come in the padded batch's layout (B, H, T, T), zero at padding.
        Returns the output (B, T, D) (always from the layer's own kernel) and, if ``need_weights``, the
        weights (B, H, T, S) before dropout, computed by the reference kernel.
        """
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"attention input must have shape (B, T, D={self.d_model}), got "
                             f"{tuple(x.shape)}")
        if packed is not None:
            if self.cross or memory is not None or mask is not None or causal or cache is not None:
                raise ValueError("packed sequences are for self-attention without a mask, causal "
                                 "mask or cache")
            if x.shape[0] != 1 or x.shape[1] != packed.tokens:
                raise ValueError(f"packed sequences must be x of shape (1, N={packed.tokens}, D), "
                                 f"got {tuple(x.shape)}")
            return self._attend_packed(x, packed, need_weights)
        if memory is not None and (memory.dim() != 3 or memory.shape[-1] != self.d_model):
            raise ValueError(f"memory must have shape (B, S, D={self.d_model}), got "
                             f"{tuple(memory.shape)}")
        batch, length, _ = x.shape
        dropout = self.dropout if self.training else 0.0
        if self.cross:
            kept = None if cache is None else cache.cross[layer_index]
            if kept is None:
                if memory is None:
                    raise ValueError("cross-attention needs the encoder output (memory)")
                kept = self.project_memory(memory)  # (keys, values), (B, H, S, Dh) each
                if cache is not None:
                    if self._folds(kept[0]):
                        kept = fold(self.q_proj, self.out_proj, *kept)
                    cache.cross[layer_index] = kept
            if isinstance(kept, FoldedCrossAttention):
                return self._attend_folded(x, kept, mask, need_weights)
            k, v = kept
            q = self._heads(linear(self.q_proj, x))  # (B, H, T, Dh)
        else:
            q, k, v = self._project_query_key_value(x)  # (B, H, T, Dh) each
            if cache is not None:
                layer_cache = cache.self_attention[layer_index]
                if not need_weights:
                    out = self.kernel.decode(q, k, v, layer_cache, cache.length, mask=mask)
                    return self._merge(out, batch, length), None
                k, v = layer_cache.write(cache.length, k, v)  # (B, H, S, Dh), S = cached + T
                causal = True
        group = _rows_per_memory(q.shape[0], k.shape[0]) if self.cross else 1
        if group > 1:  # G decoder rows share one memory row (DecoderCache.rows_per_memory)
            q = _fold_groups(q, group)  # (B / G, H, G * T, Dh)
        out = self.kernel(q, k, v, mask=mask, causal=causal, dropout=dropout)
        weights = None
        if need_weights:
            # The weights come from the reference kernel, but the output stays the layer's own kernel's,
            # so collecting attention never changes the model's numbers (the visualiser relies on it).
            weights = ReferenceAttention().with_weights(q, k, v, mask=mask, causal=causal)[1]
        if group > 1:
            out = _unfold_groups(out, group)  # (B, H, T, Dh)
            weights = None if weights is None else _unfold_groups(weights, group)  # (B, H, T, S)
        return self._merge(out, batch, length), weights

    def _attend_packed(self, x: Tensor, packed: PackedBatch, need_weights: bool
                       ) -> tuple[Tensor, Tensor | None]:
        """Self-attention within each packed sequence of x (1, N, D) -> (1, N, D), weights."""
        q, k, v = self._project_query_key_value(x)  # (1, H, N, Dh) each
        dropout = self.dropout if self.training else 0.0
        weights = (q.new_zeros(packed.batch, self.n_heads, packed.length, packed.length)
                   if need_weights else None)  # (B, H, T, T)
        parts = []
        # split, not a slice per sequence: its backward is one cat, where B slices' backwards would
        # each zero-fill and add into a gradient of all N rows.
        lengths = packed.lengths
        pieces = zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2))
        for sequence, (q_part, k_part, v_part) in enumerate(pieces):  # (1, H, L, Dh) each
            if q_part.shape[2] == 0:
                continue
            out = self.kernel(q_part, k_part, v_part, dropout=dropout)  # (1, H, L, Dh)
            parts.append(out.transpose(1, 2))  # (1, L, H, Dh)
            if need_weights:
                at = packed.positions(sequence)  # (L,)
                weights[sequence][:, at[:, None], at] = ReferenceAttention().with_weights(
                    q_part, k_part, v_part)[1][0]  # (H, L, L)
        out = torch.cat(parts, dim=1)  # (1, N, H, Dh)
        return linear(self.out_proj, out.view(1, packed.tokens, self.d_model)), weights

    def _folds(self, keys: Tensor) -> bool:
        """Whether a decoding cache keeps this cross-attention folded (aiayn.attention.folded_cross)
        for memory keys (B', H, S, Dh): inference only, a kernel that computes eq. 1 exactly (what is
        folded is that formula), plain projections without hooks, and ``worth_folding``."""
        return (folded_cross.folding_enabled and not torch.is_grad_enabled()
                and self.kernel.exact_softmax and (self.dropout == 0 or not self.training)
                and all(type(projection) is nn.Linear and not has_hooks(projection)
                        for projection in (self.q_proj, self.out_proj))
                and folded_cross.worth_folding(self.n_heads, keys.shape[2], self.d_model,
                                               keys.shape[0]))

    def _attend_folded(self, x: Tensor, folded: FoldedCrossAttention, mask: Tensor | None,
                       need_weights: bool) -> tuple[Tensor, Tensor | None]:
        """Cross-attention of x (B, T, D) through the folded cache entry: (B, T, D) and the weights
        (B, H, T, S) if ``need_weights``."""
        batch, length, _ = x.shape
        group = _rows_per_memory(batch, folded.sources)
        rows = x.reshape(folded.sources, group * length, self.d_model)  # (B / G, G * T, D)
        out, weights = folded.attend(rows, mask, need_weights)  # (B / G, G * T, D)
        if weights is not None:
            weights = _unfold_groups(weights, group)  # (B, H, T, S)
        return out.view(batch, length, self.d_model), weights

    def _merge(self, out: Tensor, batch: int, length: int) -> Tensor:
        out = out.transpose(1, 2).reshape(batch, length, self.d_model)  # (B, T, D): concat heads
        return linear(self.out_proj, out)


def _rows_per_memory(rows: int, memory_rows: int) -> int:
    """G: how many consecutive decoder rows share each memory row (``DecoderCache.rows_per_memory``)."""
    if rows % memory_rows:
        raise ValueError(f"cross-attention from {rows} rows to a memory of {memory_rows} rows: the "
                         f"memory rows must divide the query rows")
    return rows // memory_rows


def _fold_groups(x: Tensor, group: int) -> Tensor:
    """(B, H, T, X) -> (B / G, H, G * T, X): the T queries of G consecutive rows as one row's queries.

    Exact for cross-attention, whose queries attend to the memory independently of each other (no
    causal mask among them); the key-padding mask (B / G, 1, 1, S) broadcasts over the G * T queries.
    """
    batch, heads, length, width = x.shape
    x = x.view(batch // group, group, heads, length, width).transpose(1, 2)  # (B/G, H, G, T, X)
    return x.reshape(batch // group, heads, group * length, width)  # (B/G, H, G*T, X)


def _unfold_groups(x: Tensor, group: int) -> Tensor:
    """Inverse of ``_fold_groups``: (B / G, H, G * T, X) -> (B, H, T, X)."""
    sources, heads, grouped, width = x.shape
    x = x.view(sources, heads, group, grouped // group, width).transpose(1, 2)  # (B/G, G, H, T, X)
    return x.reshape(sources * group, heads, grouped // group, width)  # (B, H, T, X)


def new_decoder_cache(attentions: list[MultiHeadAttention], batch: int, max_length: int, *,
                      device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None, rows_per_memory: int = 1) -> DecoderCache:
    """A cache for the decoder stack whose self-attention modules are ``attentions`` (one per layer).

    ``rows_per_memory`` G: every G consecutive rows share one memory row (see ``DecoderCache``).
    """
    layers = [attention.kernel.new_cache(batch, attention.n_heads, max_length, attention.head_dim,
                                         device=device, dtype=dtype)
              for attention in attentions]
    return DecoderCache(layers, max_length, rows_per_memory=rows_per_memory)
