"""The one mask convention of aiayn, and the helpers that build masks.

Convention: a mask is a boolean tensor, ``True`` = this query may attend to this key (the same meaning as
``torch.nn.functional.scaled_dot_product_attention``'s boolean ``attn_mask``). Attention masks broadcast
to (B, H, T, S); the models build them as

    key padding   (B, 1, 1, S)  from a padding mask (B, S) with True = real token,
    causal        (T, S)        right-aligned: query i sits at absolute position S - T + i,
    window        (T, S)        a sliding window of W: query i sees the W - 1 keys before it and
                                itself, no further back (Mistral; Beltagy et al. 2020's local band),
    band          (S, S)        the encoder's bidirectional window of W: the W - 1 keys on either
                                side and itself (ModernBERT's local attention).

Right alignment is what decoding with a cache needs: T new queries follow S - T cached keys. (SDPA's
``is_causal=True`` is top-left aligned, which is only right when T == S.) A query row with no allowed key
attends to nothing and yields zeros (never NaN); the kernels guarantee it.

Legend: B batch, T query (target) length, S key (source) length, H heads.
"""

from __future__ import annotations

import torch
from torch import Tensor


def padding_mask_from_lengths(lengths: Tensor, max_length: int | None = None) -> Tensor:
    """(B,) lengths -> (B, S) with True at the first ``lengths[b]`` positions of row b.

    ``max_length`` fixes S; without it S = max(lengths), which reads the value (a device sync on GPU).
    """
    if lengths.dim() != 1:
        raise ValueError(f"lengths must have shape (B,), got {tuple(lengths.shape)}")
    if max_length is None:
        max_length = int(lengths.max()) if lengths.numel() else 0
    positions = torch.arange(max_length, device=lengths.device)  # (S,)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)  # (B, S)


def padding_mask_from_ids(ids: Tensor, pad_id: int) -> Tensor:
    """(B, S) token ids -> (B, S) with True where the token is not padding."""
    return ids != pad_id


def causal_mask(query_length: int, key_length: int | None = None,
                device: torch.device | str | None = None) -> Tensor:
    """(T, S) right-aligned causal mask: query i may attend key j iff j <= S - T + i."""
    key_length = query_length if key_length is None else key_length
    if query_length > key_length:
        raise ValueError(f"causal mask needs query_length <= key_length, got {query_length} > "
                         f"{key_length}")
    return torch.ones(query_length, key_length, dtype=torch.bool, device=device).tril(
        diagonal=key_length - query_length)


def window_mask(query_slots: Tensor, keys: int | Tensor, window: int) -> Tensor:
    """(T, S): key j is at most ``window - 1`` slots behind the query's slot (the causal part is
    added elsewhere). ``query_slots`` (T,): the cache slots of the queries, S - T .. S - 1 for a
    contiguous run (right-aligned, as ``causal_mask``), or a fixed-shape step's slot. ``keys``:
    S (keys at slots 0 .. S - 1), or the (S,) slots of the keys (a sliding-window cache's ring)."""
    if isinstance(keys, int):
        keys = torch.arange(keys, device=query_slots.device)  # (S,)
    return query_slots[:, None] - keys[None, :] < window  # (T, S)


def cache_window_mask(query_slots: Tensor, key_slots: Tensor, window: int,
                      key_padding: Tensor | None = None) -> Tensor:
    """A sliding layer's mask over the keys its cache returns: (T, S), or (B, 1, T, S) with
    ``key_padding`` (B, 1, 1, keys so far) gathered to the keys. ``key_slots`` (S,): the slot of
    each key (a ring cache returns them in its own order; < 0 is a slot not yet written)."""
    allowed = window_mask(query_slots, key_slots, window) & (key_slots >= 0)  # (T, S)
    if key_padding is None:
        return allowed
    return key_padding.index_select(-1, key_slots.clamp(min=0)) & allowed  # (B, 1, T, S)


def band_mask(length: int, window: int, device: torch.device | str | None = None) -> Tensor:
    """(S, S) bidirectional band: query i may attend key j iff |i - j| < ``window`` (the encoder's
    sliding window; ModernBERT's local attention of ``local_attention`` keys is ``window`` =
    local_attention // 2 + 1)."""
    positions = torch.arange(length, device=device)  # (S,)
    return (positions[:, None] - positions[None, :]).abs() < window  # (S, S)


def key_padding_to_attention(padding_mask: Tensor) -> Tensor:
    """(B, S) padding mask -> (B, 1, 1, S) attention mask (every query, every head)."""
    return padding_mask[:, None, None, :]


def attention_mask(padding_mask: Tensor | None = None, *, causal: bool = False,
                   query_length: int | None = None) -> Tensor | None:
    """Combine a key padding mask (B, S) and a right-aligned causal mask into one attention mask.

    Returns (B, 1, T, S), (B, 1, 1, S), (T, S) or None when nothing is masked.
    """
    if not causal:
        return None if padding_mask is None else key_padding_to_attention(padding_mask)
    if query_length is None:
        if padding_mask is None:
            raise ValueError("a causal mask needs query_length or a padding mask")
        query_length = padding_mask.shape[-1]
    key_length = query_length if padding_mask is None else padding_mask.shape[-1]
    device = None if padding_mask is None else padding_mask.device
    causal_part = causal_mask(query_length, key_length, device=device)  # (T, S)
    if padding_mask is None:
        return causal_part
    return key_padding_to_attention(padding_mask) & causal_part  # (B, 1, T, S)


def check_attention_mask(mask: Tensor, batch: int, query_length: int, key_length: int) -> None:
    """Raise ValueError unless ``mask`` is boolean and broadcasts to (batch, H, T, S)."""
    if mask.dtype != torch.bool:
        raise ValueError(f"attention masks must be boolean (True = may attend), got {mask.dtype}")
    if mask.dim() > 4 or mask.dim() < 2:
        raise ValueError(f"attention mask must have 2 to 4 dims broadcastable to (B, H, T, S), "
                         f"got shape {tuple(mask.shape)}")
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    wanted = (batch, None, query_length, key_length)
    for size, want, name in zip(shape, wanted, "BHTS"):
        if want is not None and size not in (1, want):
            raise ValueError(f"attention mask shape {tuple(mask.shape)} does not broadcast to "
                             f"(B={batch}, H, T={query_length}, S={key_length}): dim {name}")


def check_padding_mask(mask: Tensor, batch: int, length: int, name: str = "padding_mask") -> None:
    """Raise ValueError unless ``mask`` is a boolean (batch, length) tensor."""
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be boolean (True = real token), got {mask.dtype}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape (B={batch}, S={length}), got {tuple(mask.shape)}")
