"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): O(n) time and memory.

The softmax similarity exp(q . k) is replaced by a kernel phi(q) . phi(k) with phi(x) = elu(x) + 1
(their eq. 7), so the sum over keys factorises (their eq. 4-5):

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j))

Non-causal: both sums are computed once, O(S * Dh^2). Causal (their eq. 9-10): the sums run over the
keys up to position i. We compute them chunk-wise (as in Katharopoulos' CUDA kernel and later
chunked forms, e.g. Yang et al. 2023 "Gated linear attention"): inside a chunk of C positions the
masked quadratic form (C x C), across chunks an exclusive prefix sum of per-chunk states phi(K)^T V
(Dh x Dh). Memory is O(T * (C + Dh^2 / C)), never (T, S). For decoding the same sums are an O(1)
recurrent state (``LinearAttentionState``) that replaces the KV cache.

Masks: only key masks (one row for every query: (B|1, H|1, 1, S)) can be honoured without a (T, S)
matrix; a masked key simply drops out of both sums. A query with no allowed key returns zeros.
This kernel is not softmax attention, so it does not equal the reference kernel; the tests compare it
with the quadratic formula of the same feature map.

Legend: B batch, H heads, T query length, S key length, Dh head width, C chunk size, N chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn.nn.attention.kernels import AttentionKernel, refuse_band, refuse_position_bias


def feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al. 2020, eq. 7)."""
    return F.elu(x) + 1.0


def key_mask(mask: Tensor | None, batch: int, heads: int, query_length: int,
             key_length: int) -> Tensor | None:
    """A key mask (B|1, H|1, S) from a mask broadcastable to (B, H, T, S) whose T dim is 1.

    Raises:
        ValueError: non-boolean mask, a mask that varies over queries (e.g. (B, 1, T, S)), or one that
            does not broadcast.
    """
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"attention mask must broadcast to (B, H, T, S), got shape "
                         f"{tuple(mask.shape)}")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if mask.shape[2] != 1:
        raise ValueError(
            f"this attention kernel takes key masks only (shape (B, 1, 1, S), e.g. padding), not a "
            f"per-query mask of shape {tuple(mask.shape)}: a (T, S) mask is what it avoids building; "
            f"pass causal=True for causal masking")
    for size, want, name in zip(mask.shape, (batch, heads, 1, key_length), "BHTS"):
        if size not in (1, want):
            raise ValueError(f"attention mask shape {tuple(mask.shape)} does not broadcast to "
                             f"(B={batch}, H={heads}, T={query_length}, S={key_length}): dim {name}")
    return mask[:, :, 0]  # (B|1, H|1, S)


def _normalise(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator (..., Dh) / denominator (..., 1); rows whose keys are all masked (denominator 0) -> 0."""
    has_key = denominator > 0
    return torch.where(has_key, numerator / torch.where(has_key, denominator, 1.0), 0.0)


def causal_linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk_size: int,
                            state: Tensor | None = None, normaliser: Tensor | None = None
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """Causal linear attention of T queries over T aligned keys, after an optional prefix state.

    Args:
        phi_q, phi_k: features (B, H, T, Dh) (masked keys already zeroed); v: (B, H, T, Dv).
        chunk_size: C, the positions per chunk.
        state: sum of phi(k) v^T over earlier keys (B, H, Dh, Dv), or None for none.
        normaliser: sum of phi(k) over earlier keys (B, H, Dh), or None.

    Returns:
        The output (B, H, T, Dv) and the state and normaliser after the last key.
    """
    batch, heads, length, dim = phi_q.shape
    value_dim = v.shape[-1]
    chunks = -(-length // chunk_size)
    pad = chunks * chunk_size - length  # zero features contribute nothing to any sum
    if pad:
        phi_q, phi_k, v = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v))
    qc = phi_q.view(batch, heads, chunks, chunk_size, dim)  # (B, H, N, C, Dh)
    kc = phi_k.view(batch, heads, chunks, chunk_size, dim)  # (B, H, N, C, Dh)
    vc = v.view(batch, heads, chunks, chunk_size, value_dim)  # (B, H, N, C, Dv)
    # Within a chunk: the masked quadratic form (their eq. 9 for the nearby keys).
    within = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=phi_q.device).tril()
    similarity = (qc @ kc.transpose(-2, -1)).masked_fill(~within, 0.0)  # (B, H, N, C, C)
    numerator = similarity @ vc  # (B, H, N, C, Dv)
    denominator = similarity.sum(dim=-1, keepdim=True)  # (B, H, N, C, 1)
    # Across chunks: exclusive prefix sums of the per-chunk states.
    chunk_states = kc.transpose(-2, -1) @ vc  # (B, H, N, Dh, Dv)
    chunk_norms = kc.sum(dim=-2)  # (B, H, N, Dh)
    before_states = chunk_states.cumsum(dim=2) - chunk_states  # (B, H, N, Dh, Dv), exclusive
    before_norms = chunk_norms.cumsum(dim=2) - chunk_norms  # (B, H, N, Dh)
    if state is not None:
        before_states = before_states + state[:, :, None]
        before_norms = before_norms + normaliser[:, :, None]
    numerator = numerator + qc @ before_states  # (B, H, N, C, Dv)
    denominator = denominator + (qc * before_norms[:, :, :, None]).sum(-1, keepdim=True)
    out = _normalise(numerator, denominator).reshape(batch, heads, chunks * chunk_size, value_dim)
    final_state = before_states[:, :, -1] + chunk_states[:, :, -1]  # (B, H, Dh, Dv)
    final_norm = before_norms[:, :, -1] + chunk_norms[:, :, -1]  # (B, H, Dh)
    return out[:, :, :length], final_state, final_norm


def _refuse_grouped_heads(q: Tensor, k: Tensor) -> None:
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"linear attention keeps one state per head and needs as many key/value "
                         f"heads as query heads, got {k.shape[1]} and {q.shape[1]}")


class LinearAttentionState:
    """Decoding state of one layer: sum_j phi(k_j) v_j^T (B, H, Dh, Dh) and sum_j phi(k_j) (B, H, Dh).

    Its size does not grow with the sequence (Katharopoulos et al. 2020, 3.4: the transformer as an
    RNN). ``capacity`` only mirrors ``KVCache`` so that decoding past the allocated length is still an
    error (the position table is what really limits the length).
    """

    def __init__(self, batch: int, heads: int, max_length: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        self.state = torch.zeros(batch, heads, head_dim, head_dim, device=device, dtype=dtype)
        self.normaliser = torch.zeros(batch, heads, head_dim, device=device, dtype=dtype)
        self.capacity = max_length
        self.length = 0  # positions folded into the state

    @property
    def batch(self) -> int:
        return self.state.shape[0]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) in place of the old rows, e.g. surviving beams."""
        self.state = self.state.index_select(0, index)
        self.normaliser = self.normaliser.index_select(0, index)


class LinearAttention(AttentionKernel):
    """Linear attention with the elu + 1 feature map (``attention="linear"``).

    Args:
        chunk_size: positions per chunk of the causal form (``config.attention_chunk_size``).
    """

    exact_softmax = False  # no softmax weights to draw (attention maps)

    def __init__(self, chunk_size: int = 64):
        super().__init__()
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                causal: bool = False, dropout: float = 0.0,
                position_bias: Tensor | None = None, band: int | None = None) -> Tensor:
        refuse_position_bias(position_bias, "linear")
        refuse_band(band, "linear")
        _refuse_grouped_heads(q, k)
        if dropout > 0:
            raise ValueError(f"linear attention has no attention weights to drop out (got dropout="
                             f"{dropout}); set attention_dropout=0")
        batch, heads, query_length, _ = q.shape
        key_length = k.shape[2]
        keys_allowed = key_mask(mask, batch, heads, query_length, key_length)  # (B|1, H|1, S)
        phi_q, phi_k = feature_map(q), feature_map(k)
        if keys_allowed is not None:
            phi_k = phi_k * keys_allowed[..., None].to(phi_k.dtype)  # masked keys drop out
        if not causal:
            state = phi_k.transpose(-2, -1) @ v  # (B, H, Dh, Dv)
            normaliser = phi_k.sum(dim=2)  # (B, H, Dh)
            return _normalise(phi_q @ state, phi_q @ normaliser[..., None])
        if query_length > key_length:
            raise ValueError(f"causal attention needs query_length <= key_length, got "
                             f"{query_length} > {key_length}")
        # Right-aligned: the first S - T keys precede every query; the rest align with the queries.
        prefix = key_length - query_length
        state = normaliser = None
        if prefix:
            state = phi_k[:, :, :prefix].transpose(-2, -1) @ v[:, :, :prefix]  # (B, H, Dh, Dv)
            normaliser = phi_k[:, :, :prefix].sum(dim=2)  # (B, H, Dh)
        return causal_linear_attention(phi_q, phi_k[:, :, prefix:], v[:, :, prefix:],
                                       self.chunk_size, state, normaliser)[0]

    def new_cache(self, batch: int, heads: int, max_length: int, head_dim: int, *,
                  window: int | None = None, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> LinearAttentionState:
        refuse_band(window, "linear")
        return LinearAttentionState(batch, heads, max_length, head_dim, device=device, dtype=dtype)

    def decode(self, q: Tensor, k: Tensor, v: Tensor, cache: LinearAttentionState, start: int,
               mask: Tensor | None = None, position_bias: Tensor | None = None,
               band: int | None = None) -> Tensor:
        """Causal attention of T new queries at positions start.. given the state of earlier keys.

        ``mask`` covers every key so far, (B, 1, 1, start + T); only its last T columns are read,
        because earlier keys were masked when they entered the state.
        """
        refuse_position_bias(position_bias, "linear")
        refuse_band(band, "linear")
        _refuse_grouped_heads(q, k)
        if not isinstance(cache, LinearAttentionState):
            raise ValueError(f"linear attention decodes with a LinearAttentionState, got "
                             f"{type(cache).__name__}")
        if isinstance(start, Tensor):
            raise ValueError("linear attention keeps a recurrent state, not slots: decode it with "
                             "integer positions (no fixed-shape steps)")
        length = k.shape[2]
        if start != cache.length:
            raise ValueError(f"linear attention state holds {cache.length} positions but the new "
                             f"keys start at position {start}")
        if start + length > cache.capacity:
            raise ValueError(f"linear attention state allocated for {cache.capacity} positions; "
                             f"positions {start}..{start + length - 1} overflow it")
        batch, heads = q.shape[:2]
        keys_allowed = key_mask(mask, batch, heads, length, start + length)
        phi_q, phi_k = feature_map(q), feature_map(k)
        if keys_allowed is not None:
            phi_k = phi_k * keys_allowed[..., start:, None].to(phi_k.dtype)
        out, cache.state, cache.normaliser = causal_linear_attention(
            phi_q, phi_k, v, self.chunk_size, cache.state, cache.normaliser)
        cache.length = start + length
        return out

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"
