"""Static key/value cache for incremental decoding.

Preallocated once per generation at (B, H, S_max, Dh) and written in place at the positions of the new
tokens, so no step allocates or concatenates (pytorch-labs/gpt-fast's ``KVCache.update``). Reading it
returns views of the filled prefix: no copy, and attention costs what the filled length costs rather
than S_max (on CPU that difference dominates short generations).

Legend: B batch (times beams), H heads, S_max cache capacity, T new tokens, Dh head width.
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

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def write(self, start: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store (B, H, T, Dh) keys/values at positions start..start+T-1; return the filled prefix.

        Returns keys and values of shape (B, H, start + T, Dh), views into the cache.
        """
        end = start + keys.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; writing positions "
                             f"{start}..{end - 1} overflows it (allocate a longer cache)")
        self.keys.narrow(2, start, end - start).copy_(keys)  # narrow: one view op, no indexing
        self.values.narrow(2, start, end - start).copy_(values)
        return self.keys.narrow(2, 0, end), self.values.narrow(2, 0, end)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) in place of the old rows, e.g. surviving beams."""
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)


class DecoderCache:
    """Everything a decoder stack remembers between decoding steps.

    ``length`` is the number of positions already written; the model advances it after each step.
    Cross-attention keys/values depend only on the source, so they are computed on the first step and
    reused (``cross`` holds one (keys, values) pair per layer once filled).
    """

    def __init__(self, layers: list[object], max_length: int):
        self.self_attention = layers  # one cache per layer, made by that layer's attention kernel
        self.cross: list[tuple[Tensor, Tensor] | None] = [None] * len(layers)
        self.max_length = max_length
        self.length = 0

    def reorder(self, index: Tensor, *, cross: bool = True) -> None:
        """Select batch rows (beam search): every layer's caches follow ``index`` (B',).

        ``cross=False`` leaves the cross-attention keys/values alone: right when ``index`` only moves
        rows among the beams of the same source, which share them (a copy per step saved).
        """
        for cache in self.self_attention:
            cache.reorder(index)
        if not cross:
            return
        self.cross = [None if kv is None else (kv[0].index_select(0, index),
                                               kv[1].index_select(0, index))
                      for kv in self.cross]
