"""Static key/value cache for incremental decoding.

Preallocated once per generation at (B, H, S_max, Dh) and written in place at the positions of the new
tokens, so no step allocates or concatenates (pytorch-labs/gpt-fast's ``KVCache.update``). Reading it
returns views of the filled prefix: no copy, and attention costs what the filled length costs rather
than S_max (on CPU that difference dominates short generations).

Beam search reorders the rows every step. ``KVCache.reorder`` gathers only the filled prefix into a
second preallocated buffer and swaps the two (double buffering), so a step allocates nothing and never
copies the unwritten tail. Beams of one source share its cross-attention keys/values: a cache made
with ``rows_per_memory = K`` keeps them once per source (B / K rows) and the cross-attention groups each
source's K query rows together (``CrossAttention``), so they are neither repeated nor reordered.

A sliding-window layer (Mistral, Gemma 2/3, Qwen2, Phi-3) never reads a key more than W - 1
positions behind its query, so its cache is ``SlidingKVCache``: a ring of W slots, position p in
slot p mod W (transformers' sliding-window cache layer, Mistral's rotating buffer). Its memory is W,
not S_max, per layer, and a decoding step attends to W keys, not to all of them.

Legend: B batch (times beams), H heads, S_max cache capacity, T new tokens, Dh head width,
W window.
"""

from __future__ import annotations

import torch
from torch import Tensor



class KVCache:
    """Keys and values of one self-attention layer, indexed by absolute position."""

    def __init__(self, batch: int, heads: int, max_length: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        shape = (batch, heads, max_length, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # (B, H, S_max, Dh)
        self.values = torch.zeros(shape, device=device, dtype=dtype)  # (B, H, S_max, Dh)
        self._spare: tuple[Tensor, Tensor] | None = None  # the second buffer of ``reorder``

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    def write(self, start: int | Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, H, T, Dh) keys/values at positions start..start+T-1; return the filled prefix,
        (B, H, start + T, Dh) views into the cache.

        ``start`` may be a (T,) tensor of slots instead (a fixed-shape step, as a CUDA graph
        replays it): the keys go to those slots and the whole cache (B, H, S_max, Dh) is returned;
        the caller's mask says which slots hold keys.
        """
        if isinstance(start, Tensor):
            self.keys.index_copy_(2, start, keys)
            self.values.index_copy_(2, start, values)
            return self.keys, self.values
        end = start + keys.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; writing positions "
                             f"{start}..{end - 1} overflows it (allocate a longer cache)")
        self.keys.narrow(2, start, end - start).copy_(keys)  # narrow: one view op, no indexing
        self.values.narrow(2, start, end - start).copy_(values)
        return self.keys.narrow(2, 0, end), self.values.narrow(2, 0, end)

    def key_slots(self, start: int | Tensor, length: int) -> Tensor:
        """The position of every key ``write(start, ...)`` of ``length`` new ones returns, (S,):
        0 .. start + length - 1, or every slot for a fixed-shape step (``start`` a tensor)."""
        device = self.keys.device
        if isinstance(start, Tensor):
            return torch.arange(self.capacity, device=device)  # (S_max,)
        return torch.arange(start + length, device=device)  # (start + T,)

    def can_rewind(self, keep: int, length: int) -> bool:
        """Whether, holding positions 0 .. length - 1, it can go back to holding 0 .. keep - 1 (a
        ``PrefixCache`` keeping a shared prefix): always, positions are never overwritten."""
        return True

    def copy_prefix(self, other: KVCache, keep: int) -> None:
        """Take positions 0 .. keep - 1 from ``other`` (a smaller cache of the same layer)."""
        self.keys[:, :, :keep].copy_(other.keys[:, :, :keep])  # (B, H, keep, Dh)
        self.values[:, :, :keep].copy_(other.values[:, :, :keep])

    def reorder(self, index: Tensor, *, filled: int | None = None) -> None:
        """Keep batch rows ``index`` (B',) in place of the old rows, e.g. surviving beams.

        Args:
            index: (B',) row indices into the current batch.
            filled: slots written so far; only those are moved (default: every slot).
                Positions at or past ``filled`` hold stale values afterwards (they are overwritten
                before they are ever read).
        """
        batch = self.keys.shape[0]
        filled = self.keys.shape[2] if filled is None else filled
        # New tensors when the batch shrinks (finished sentences leave) or when the cache is part of an
        # autograd graph (in-place ``out=`` writes cannot be differentiated).
        if index.shape[0] != batch or (torch.is_grad_enabled() and self.keys.requires_grad):
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)
            self._spare = None
            return
        if self._spare is None:
            self._spare = (torch.empty_like(self.keys), torch.empty_like(self.values))
        new_keys, new_values = self._spare
        if filled > 0:
            torch.index_select(self.keys.narrow(2, 0, filled), 0, index,
                               out=new_keys.narrow(2, 0, filled))  # (B, H, filled, Dh)
            torch.index_select(self.values.narrow(2, 0, filled), 0, index,
                               out=new_values.narrow(2, 0, filled))
        self._spare = (self.keys, self.values)
        self.keys, self.values = new_keys, new_values


class SlidingKVCache(KVCache):
    """Keys and values of a sliding-window layer: position p in slot p mod W of a ring of W slots.

    A query at position q attends to positions q - W + 1 .. q, so writing position p may overwrite
    p - W, which no later query reads. ``capacity`` stays the positions the decoder may reach
    (S_max, for the overflow check); the buffers hold W.

    What ``write`` returns, and ``key_slots`` says the positions of:

    - one new key (T = 1): every slot written so far, in slot order, which is position order until
      the ring wraps (a fixed-shape step: all W slots, some maybe empty). Order does not matter to
      attention: the keys are already rotated, and the mask follows ``key_slots``.
    - T > 1 new keys at ``start`` (a prefill, or the rest of a prompt after a kept prefix): the
      W - 1 positions before ``start`` (fewer near 0) then the T new ones, in position order, so
      the kernel's right-aligned causal mask holds; the last W of them are then stored.
    """

    def __init__(self, batch: int, heads: int, max_length: int, head_dim: int, window: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive integer, got {window!r}")
        super().__init__(batch, heads, min(window, max_length), head_dim, device=device,
                         dtype=dtype)
        self.window = window
        self.max_length = max_length

    @property
    def capacity(self) -> int:
        return self.max_length

    @property
    def slots(self) -> int:
        """W (or S_max when that is smaller): the positions the buffers hold at once."""
        return self.keys.shape[2]

    def write(self, start: int | Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, H, T, Dh) keys/values of positions start .. start + T - 1; return the keys and
        values to attend to (see the class docstring), (B, H, S, Dh)."""
        length, ring = keys.shape[2], self.slots
        if isinstance(start, Tensor):  # a fixed-shape step: one key, at a slot on the device
            self.keys.index_copy_(2, start % ring, keys)
            self.values.index_copy_(2, start % ring, values)
            return self.keys, self.values
        end = start + length
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; writing positions "
                             f"{start}..{end - 1} overflows it (allocate a longer cache)")
        if length == 1:
            self.keys.narrow(2, start % ring, 1).copy_(keys)
            self.values.narrow(2, start % ring, 1).copy_(values)
            filled = min(end, ring)
            return self.keys.narrow(2, 0, filled), self.values.narrow(2, 0, filled)
        first = self._first_read(start)
        if first < start:  # read before storing: the new keys may overwrite these slots
            held = torch.arange(first, start, device=keys.device) % ring  # (start - first,)
            attend_keys = torch.cat([self.keys.index_select(2, held), keys], dim=2)
            attend_values = torch.cat([self.values.index_select(2, held), values], dim=2)
        else:
            attend_keys, attend_values = keys, values
        kept = min(length, ring)  # the newest W positions stay
        slots = torch.arange(end - kept, end, device=keys.device) % ring  # (kept,)
        self.keys.index_copy_(2, slots, keys[:, :, length - kept:])
        self.values.index_copy_(2, slots, values[:, :, length - kept:])
        return attend_keys, attend_values  # (B, H, start - first + T, Dh)

    def key_slots(self, start: int | Tensor, length: int) -> Tensor:
        """Positions of the keys ``write`` returns, (S,); negative for a slot not yet written."""
        ring = self.slots
        device = self.keys.device
        if isinstance(start, Tensor) or (length == 1 and start >= ring):
            slot = torch.arange(ring, device=device)  # (W,): slot j holds the latest p = j mod W
            return start - (start - slot) % ring  # (W,); < 0 where nothing is written yet
        if length == 1:
            return torch.arange(start + 1, device=device)  # the ring has not wrapped
        return torch.arange(self._first_read(start), start + length, device=device)

    def _first_read(self, start: int) -> int:
        """The earliest position a run of new queries from ``start`` reads (its first query's
        window), where ``write`` starts what it returns."""
        return max(0, start - (self.window - 1))

    def can_rewind(self, keep: int, length: int) -> bool:
        """Going back to positions 0 .. keep - 1 needs keep - W + 1 .. keep - 1 still held: true
        while the ring has not wrapped, or when at most one position is dropped."""
        return length <= self.slots or keep >= length - 1

    def copy_prefix(self, other: KVCache, keep: int) -> None:
        """Take what a later query of ``other`` (a smaller cache of the same layer) may read of
        positions 0 .. keep - 1: slots hold the same positions in both rings, and a cache too
        small for a ring held at most W positions, in their slots."""
        held = min(keep, self.slots, other.keys.shape[2])
        self.keys[:, :, :held].copy_(other.keys[:, :, :held])
        self.values[:, :, :held].copy_(other.values[:, :, :held])

    def reorder(self, index: Tensor, *, filled: int | None = None) -> None:
        """As ``KVCache.reorder``; ``filled`` positions occupy min(filled, W) slots."""
        super().reorder(index, filled=None if filled is None else min(filled, self.slots))


class MemoryCache:
    """Keys and values (B / G, H, S, Dh) of one cross-attention layer: a function of the source alone,
    so they are projected on the first decoding step and read by every later one."""

    def __init__(self):
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def select(self, index: Tensor) -> None:
        """Keep the memory rows ``index`` (sentences leaving a batch)."""
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index)
            self.values = self.values.index_select(0, index)


class DecoderCache:
    """Everything a decoder stack remembers between decoding steps.

    ``length`` is the number of positions already written; the model advances it after each step.
    ``self_attention`` holds one cache per layer, made by that layer's attention kernel (a
    ``KVCache`` for softmax attention); ``cross`` one ``MemoryCache`` per layer.

    ``rows_per_memory`` (G): every G consecutive decoder rows attend to the same memory row (beam
    search: G = K beams per source). The memory, its padding mask and the cross keys/values then have
    B / G rows, and cross-attention folds each group's queries into one row of G queries (exact: a
    cross-attention query never sees the other queries).
    """

    def __init__(self, layers: list[object], max_length: int, *, rows_per_memory: int = 1):
        if not isinstance(rows_per_memory, int) or rows_per_memory < 1:
            raise ValueError(f"rows_per_memory must be a positive integer, got {rows_per_memory!r}")
        self.self_attention = layers
        self.cross = [MemoryCache() for _ in layers]
        self.max_length = max_length
        self.rows_per_memory = rows_per_memory
        self.length = 0

    def reorder(self, index: Tensor, *, cross: bool = True) -> None:
        """Select batch rows (beam search): every layer's caches follow ``index`` (B',).

        ``cross=False`` leaves the cross-attention keys/values alone: right when ``index`` only moves
        rows among the beams of the same source, which share them (a copy per step saved). With
        ``rows_per_memory`` > 1 the cross keys/values are per source: use ``select_sources``.
        """
        for cache in self.self_attention:
            if isinstance(cache, KVCache):
                cache.reorder(index, filled=self.length)
            else:
                cache.reorder(index)
        if not cross:
            return
        if self.rows_per_memory != 1:
            raise ValueError("this cache shares cross-attention keys/values among "
                             f"{self.rows_per_memory} rows; reorder(..., cross=False) and "
                             "select_sources(...) keep them consistent")
        self.select_sources(index)

    @property
    def batch(self) -> int | None:
        """Rows the self-attention caches hold (None for a decoder without layers)."""
        return self.self_attention[0].batch if self.self_attention else None

    @property
    def source_length(self) -> int | None:
        """Length S of the memory the cross-attention keeps (None before the first step)."""
        keys = self.cross[0].keys if self.cross else None
        return None if keys is None else keys.shape[2]

    def select_sources(self, index: Tensor) -> None:
        """Keep the cross-attention keys/values of sources ``index`` (B' / G,) (sentences leaving)."""
        for memory in self.cross:
            memory.select(index)
