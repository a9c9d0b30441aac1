"""Multi-head attention (paper 3.2.2): project, split into heads, attend, concatenate, project.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

The h per-head projections are one (D, D) ``nn.Linear`` each for Q, K and V, or one fused (D, 3D)
``qkv_proj`` for self-attention and one (D, 2D) ``kv_proj`` for the keys and values of
cross-attention. With grouped-query attention (Ainslie et al. 2023) K and V have Hkv < H heads, each
shared by H / Hkv query heads, so their projections (and the KV cache) are Hkv / H the size; a head
width Dh other than D / H (T5 v1.1) makes the inner width H * Dh. The attention itself is a kernel
object (aiayn.nn.attention.kernels), so reference / fused / efficient kernels are interchangeable.
Rotary positions (aiayn.nn.rotary) rotate q and k after the projection, before the cache; a position
bias (aiayn.nn.relative_bias) goes to the kernel, and so do DeBERTa's disentangled terms
(aiayn.nn.disentangled), which the layer computes from its q and k and the stack's relative table.
QK-norm (Dehghani et al. 2023; Qwen3, Gemma 3) normalises each head's queries and keys over Dh right
after the projection, before the rotation.
Two modules share the projections' plumbing:

- ``SelfAttention``: queries, keys and values from the same sequence; with a cache, the T newest
  positions attend to everything written so far (the kernel's ``decode``).
- ``CrossAttention``: queries from the decoder, keys and values from the encoder output (the
  "memory"); with a cache they are projected on the first decoding step and kept.

Legend: B batch, T query length, S key length, H heads, Hkv key/value heads, D model width,
Dh head width (D / H unless set), G decoder rows per memory row (beam search).
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.nn.attention.cache import KVCache, MemoryCache
from aiayn.nn.attention.kernels import AttentionKernel, ReferenceAttention
from aiayn.nn.disentangled import DisentangledTerms, RelativeTable
from aiayn.nn.rotary import Rotation, apply_rotary


class MultiHeadAttention(nn.Module):
    """What self- and cross-attention share: head split/merge, the kernel, the output projection.

    Args:
        d_model: model width D.
        n_heads: number of query heads H; must divide D unless ``head_dim`` is given.
        kernel: the attention kernel (e.g. ``FusedAttention()``).
        n_kv_heads: key/value heads Hkv, dividing H (None: H, the paper).
        head_dim: Dh (None: D / H).
        dropout: dropout on the attention weights (training only).
        bias: biases on the projections.
        qkv_bias: biases on the q, k and v projections only (None: ``bias``); Qwen2 has them
            without one on the output projection.
        q_norm, k_norm: modules over Dh applied to every head's queries and keys (QK-norm), or None.
    """

    def __init__(self, d_model: int, n_heads: int, kernel: AttentionKernel, *,
                 n_kv_heads: int | None = None, head_dim: int | None = None,
                 dropout: float = 0.0, bias: bool = True, qkv_bias: bool | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        super().__init__()
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.dropout = dropout
        self.kernel = kernel
        self.qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_norm, self.k_norm = q_norm, k_norm
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)

    def split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        """(B, L, heads * Dh) -> (B, heads, L, Dh); ``heads`` defaults to H."""
        batch, length, _ = x.shape
        heads = self.n_heads if heads is None else heads
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)  # (B, heads, L, Dh)

    def merge_heads(self, out: Tensor) -> Tensor:
        """(B, H, T, Dh) -> (B, T, D): concatenate the heads, then W^O."""
        batch, heads, length, width = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, heads * width))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
               need_weights: bool, position_bias: Tensor | None = None, band: int | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """The kernel's output (B, H, T, Dh) and, if ``need_weights``, the weights (B, H, T, S)
        before dropout from the reference kernel (the output stays the layer's own kernel's, so
        collecting attention never changes the model's numbers)."""
        if need_weights and not self.kernel.exact_softmax:
            raise ValueError(f"return_attention: the {self.kernel.__class__.__name__} kernel does "
                             f"not compute softmax weights, so there are no maps to return (load "
                             f"the weights into a model with attention='fused' to draw eq. 1's)")
        out = self.kernel(q, k, v, mask=mask, causal=causal,
                          dropout=self.dropout if self.training else 0.0,
                          position_bias=position_bias, band=band)
        weights = None
        if need_weights:
            weights = ReferenceAttention(self.kernel.scale,
                                         getattr(self.kernel, "softcap", None)).with_weights(
                q, k, v, mask=mask, causal=causal, position_bias=position_bias, band=band)[1]
        return out, weights

    def check_input(self, x: Tensor, name: str = "attention input", length: str = "T") -> None:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{name} must have shape (B, {length}, D={self.d_model}), got "
                             f"{tuple(x.shape)}")


class SelfAttention(MultiHeadAttention):
    """Every position of x (B, T, D) attends to the positions of x (and, decoding, of the cache).

    ``fused_projections``: one (D, 3D) product for q, k, v instead of three (D, D) ones.
    ``disentangled``: DeBERTa's c2p / p2c terms (aiayn.nn.disentangled), added to the scores when
    the stack hands ``forward`` its relative table.
    """

    def __init__(self, d_model: int, n_heads: int, kernel: AttentionKernel, *,
                 n_kv_heads: int | None = None, head_dim: int | None = None,
                 fused_projections: bool = True, dropout: float = 0.0, bias: bool = True,
                 qkv_bias: bool | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None, disentangled: DisentangledTerms | None = None):
        super().__init__(d_model, n_heads, kernel, n_kv_heads=n_kv_heads, head_dim=head_dim,
                         dropout=dropout, bias=bias, qkv_bias=qkv_bias, q_norm=q_norm,
                         k_norm=k_norm)
        self.fused_projections = fused_projections
        self.disentangled = disentangled
        inner, kv_inner = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split_sizes = (inner, kv_inner, kv_inner)
        if fused_projections:
            self.qkv_proj = nn.Linear(d_model, inner + 2 * kv_inner, bias=self.qkv_bias)
        else:
            self.q_proj = nn.Linear(d_model, inner, bias=self.qkv_bias)
            self.k_proj = nn.Linear(d_model, kv_inner, bias=self.qkv_bias)
            self.v_proj = nn.Linear(d_model, kv_inner, bias=self.qkv_bias)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, Dh), keys and values (B, Hkv, T, Dh) of x (B, T, D)."""
        if self.fused_projections:
            q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)  # (B, T, H*Dh | Hkv*Dh)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = self.split_heads(q), self.split_heads(k, self.n_kv_heads)
        if self.q_norm is not None:  # QK-norm: each head's vectors over Dh
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.split_heads(v, self.n_kv_heads)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, causal: bool = False,
                cache: KVCache | None = None, start: int | Tensor = 0,
                rotation: Rotation | None = None, position_bias: Tensor | None = None,
                relative: RelativeTable | None = None, band: int | None = None,
                need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Attend from x (B, T, D) to itself; returns (B, T, D) and the weights or None.

        ``mask`` broadcasts to (B, H, T, S), True = may attend; ``causal`` adds the right-aligned
        causal mask; ``band`` W keeps each query to the keys less than W positions away on either
        side (an encoder's sliding window; with ``causal``, a decoder's over a whole sequence, with
        no cache or an empty one). With a ``cache`` (this layer's, made by its kernel) x holds the T
        newest positions, ``start ..``: they are written to the cache and attend causally to all
        S = start + T positions. ``rotation``: the (cos, sin) of x's positions (rotary positions);
        ``position_bias`` (B|1, H, T, S): added to the scores (T5); ``relative``: the stack's
        relative table, from which ``disentangled`` adds DeBERTa's terms to the scores (no cache).
        """
        self.check_input(x)
        q, k, v = self.project(x)  # (B, H, T, Dh), (B, Hkv, T, Dh) x 2
        if relative is not None:
            if self.disentangled is None or cache is not None or position_bias is not None:
                raise ValueError("a relative table needs a layer with disentangled attention, "
                                 "without a cache or another position bias")
            position_bias = self.disentangled(q, k, relative, self)  # (B, H, T, S)
        if rotation is not None:  # RoFormer eq. 14: rotate q and k by their positions' angles
            q, k = apply_rotary(q, rotation), apply_rotary(k, rotation)
        if cache is None:
            out, weights = self.attend(q, k, v, mask, causal, need_weights, position_bias, band)
        elif band is not None and (isinstance(start, Tensor) or start != 0):
            raise ValueError("a band covers a whole sequence: without a cache, or from position 0 "
                             "of an empty one")
        elif need_weights:
            k, v = cache.write(start, k, v)  # (B, Hkv, S, Dh)
            out, weights = self.attend(q, k, v, mask, True, need_weights, position_bias, band)
        else:
            out = self.kernel.decode(q, k, v, cache, start, mask=mask, position_bias=position_bias,
                                     band=band)
            weights = None
        return self.merge_heads(out), weights


class CrossAttention(MultiHeadAttention):
    """Decoder positions x (B, T, D) attend to the encoder output ``memory`` (B / G, S, D).

    ``fused_projections``: one (D, 2D) product for the memory's keys and values.
    """

    def __init__(self, d_model: int, n_heads: int, kernel: AttentionKernel, *,
                 n_kv_heads: int | None = None, head_dim: int | None = None,
                 fused_projections: bool = True, dropout: float = 0.0, bias: bool = True,
                 qkv_bias: bool | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None):
        super().__init__(d_model, n_heads, kernel, n_kv_heads=n_kv_heads, head_dim=head_dim,
                         dropout=dropout, bias=bias, qkv_bias=qkv_bias, q_norm=q_norm,
                         k_norm=k_norm)
        self.fused_projections = fused_projections
        inner, kv_inner = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split_sizes = (kv_inner, kv_inner)
        self.q_proj = nn.Linear(d_model, inner, bias=self.qkv_bias)
        if fused_projections:
            self.kv_proj = nn.Linear(d_model, 2 * kv_inner, bias=self.qkv_bias)
        else:
            self.k_proj = nn.Linear(d_model, kv_inner, bias=self.qkv_bias)
            self.v_proj = nn.Linear(d_model, kv_inner, bias=self.qkv_bias)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, Hkv, S, Dh) of the memory (B, S, D)."""
        self.check_input(memory, "memory", "S")
        if self.fused_projections:
            k, v = self.kv_proj(memory).split(self.split_sizes, dim=-1)  # 2 x (B, S, Hkv*Dh)
        else:
            k, v = self.k_proj(memory), self.v_proj(memory)
        k = self.split_heads(k, self.n_kv_heads)
        return (k if self.k_norm is None else self.k_norm(k)), self.split_heads(v, self.n_kv_heads)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask: Tensor | None = None,
                cache: MemoryCache | None = None, need_weights: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """Returns (B, T, D) and the weights (B, H, T, S) or None.

        ``mask`` broadcasts to (B / G, H, T, S) (the memory's key padding). With a ``cache`` the
        memory's keys and values are projected on the first call and read afterwards (``memory``
        may then be None). G = B / memory rows > 1 when several decoder rows share a memory row
        (``DecoderCache.rows_per_memory``).
        """
        self.check_input(x)
        if cache is not None and cache.keys is not None:
            k, v = cache.keys, cache.values
        elif memory is None:
            raise ValueError("cross-attention needs the encoder output (memory)")
        else:
            k, v = self.project_memory(memory)  # (B / G, Hkv, S, Dh) each
            if cache is not None:
                cache.keys, cache.values = k, v
        q = self.split_heads(self.q_proj(x))  # (B, H, T, Dh)
        q = q if self.q_norm is None else self.q_norm(q)
        group = rows_per_memory(q.shape[0], k.shape[0])
        if group > 1:
            q = fold_groups(q, group)  # (B / G, H, G * T, Dh)
        out, weights = self.attend(q, k, v, mask, False, need_weights)
        if group > 1:
            out = unfold_groups(out, group)  # (B, H, T, Dh)
            weights = None if weights is None else unfold_groups(weights, group)
        return self.merge_heads(out), weights


def rows_per_memory(rows: int, memory_rows: int) -> int:
    """G: how many consecutive decoder rows share each memory row."""
    if rows % memory_rows:
        raise ValueError(f"cross-attention from {rows} rows to a memory of {memory_rows} rows: the "
                         f"memory rows must divide the query rows")
    return rows // memory_rows


def fold_groups(x: Tensor, group: int) -> Tensor:
    """(B, H, T, X) -> (B / G, H, G * T, X): the T queries of G consecutive rows as one row's queries.

    Exact for cross-attention, whose queries attend to the memory independently of each other (no
    causal mask among them); the key-padding mask (B / G, 1, 1, S) broadcasts over the G * T queries.
    """
    batch, heads, length, width = x.shape
    x = x.view(batch // group, group, heads, length, width).transpose(1, 2)  # (B/G, H, G, T, X)
    return x.reshape(batch // group, heads, group * length, width)  # (B/G, H, G*T, X)


def unfold_groups(x: Tensor, group: int) -> Tensor:
    """Inverse of ``fold_groups``: (B / G, H, G * T, X) -> (B, H, T, X)."""
    sources, heads, grouped, width = x.shape
    x = x.view(sources, heads, group, grouped // group, width).transpose(1, 2)  # (B/G, G, H, T, X)
    return x.reshape(sources * group, heads, grouped // group, width)  # (B, H, T, X)
