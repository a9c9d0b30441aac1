"""Carrying one ``generate`` call's KV cache into the next: the turns of a conversation.

A chat answers each turn with the whole conversation so far, laid out by its template, so turn k's
prompt starts with the ids that turn k - 1 prompted and generated. ``PrefixCache`` keeps the last
call's cache and the ids whose keys and values it holds (prompt, then the new tokens fed back, as
generated); the next call keeps the longest prefix its prompt shares with those ids and prefills
only the rest, as llama.cpp's prompt cache and ``transformers``' ``generate(past_key_values=...)``
reuse a prefix. The template re-encodes a reply (it may tokenize differently) and closes the turn
with tokens of its own: the shared prefix stops where the ids first differ, whatever the reason.
On a scripted 8-turn conversation with a small decoder (CPU, 2 threads) the whole conversation
takes 0.82x the time of full prefills (benchmarks/chat_prefix.py; more for larger models).

Exact up to float rounding: a position's keys and values depend only on the ids up to it and on
its position, and the kept positions are the same positions with the same ids. The prefill of the
rest attends to them as a full prefill would (greedy tokens are the same; a sampled reply draws the
same number of times from its stream). At least the prompt's last id is always prefilled: its
logits pick the first new token.

The cache grows by doubling (never past the call's context), the kept prefix copied over, so a
conversation allocates a few times rather than once per turn, and never more than the context.

A full prefill instead (the reason in ``fallback``) when nothing is kept (the first call,
``reset``, a call that slid its window: the cache holds re-based positions), when nothing is
shared, and when a kept prefix would not be exact or cannot be kept:

- a left-padded batch (several prompts of different lengths), or another number of rows;
- the model's parameters moved to another device or dtype, or the call's context is smaller
  than the cache;
- LongRoPE (``rope_scaling`` "longrope", aiayn.nn.rotary) when the kept keys were turned by one set
  of factors and this prompt would be by the other (one side past the switch, the other not);
- a layer whose cache is a recurrent state (linear attention), which cannot be cut back, or a
  sliding-window layer's ring that has overwritten positions the rest of the prompt would read
  (it holds the last W: a prompt that keeps all but at most one cached id is fine);
- steps that own their caches (``Steps.owns_caches``: ``aiayn.fast``'s CUDA-graph steps keep one
  cache per shape and hand it to the next call of that shape, so it is not this object's to keep).

A ``PrefixCache`` serves one model; changing its weights in place is not noticed: ``reset`` then.

Legend: B batch (rows), L prompt length, S ids the cache holds, K kept positions, C capacity.
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn

from aiayn.nn.attention.cache import KVCache
from aiayn.nn.rotary import longrope_switch


class PrefixCache:
    """The cache of the last ``generate`` call that was given this object, and the ids it holds.

    Pass it to every call of a conversation: ``generate(model, ids, config, prefix_cache=cache)``
    (or ``InferenceEngine.generate``). Not thread-safe: one call at a time.

    Attributes (of the last call):
        kept: positions of the prompt taken from the cache (0: a full prefill).
        prefilled: positions its prefill ran (the prompt's length minus ``kept``).
        fallback: why it prefilled the whole prompt, or None where it kept a prefix.
    """

    def __init__(self):
        self.kept = self.prefilled = 0
        self.fallback: str | None = None
        self._owner: weakref.ref | None = None  # the model whose keys the cache holds
        self._calling: tuple | None = None  # this call's ((device, dtype), steps own caches?)
        self.reset("nothing kept yet")

    def reset(self, why: str = "the prefix cache was reset") -> None:
        """Forget the cache (its memory is freed): the next call prefills its whole prompt."""
        self._cache = None
        self._ids: Tensor | None = None  # (B, S): the ids of cache positions 0..S-1
        self._storage: tuple | None = None  # (device, dtype) of the model when it was kept
        self._forgotten = why

    @property
    def held(self) -> int:
        """Positions the cache holds now (0 when there is none)."""
        return 0 if self._ids is None else self._ids.shape[1]

    @property
    def allocated(self) -> int:
        """Positions the cache has room for (0 when there is none)."""
        return 0 if self._cache is None else self._cache.max_length

    def prefill(self, model: nn.Module, steps, sequence: Tensor, real: Tensor, width: int,
                padded: bool, capacity: int, fed: int) -> tuple[object, Tensor, Tensor | None]:
        """``generate``'s first prefill: columns 0..width-1 of ``sequence`` (B, L + N) in a cache,
        the shared prefix kept and the rest run. The cache holds at least min(capacity, fed)
        positions (``fed``: those the call feeds) and at most ``capacity``, so it fills, and
        generate slides, where generate's own cache of min(capacity, fed) would. Returns the
        cache, the last logits (B, V) and (left-padded batches) the next positions (B, 1), as
        ``Steps.prefill``.

        Raises:
            ValueError: the cache holds another model's keys.
        """
        owner = None if self._owner is None else self._owner()
        if self._ids is not None and owner is not model:
            raise ValueError("this PrefixCache holds the keys of another model: use one "
                             "PrefixCache per model, or reset() it first")
        storage, needed = _storage(model), min(capacity, fed)
        cache, ids, same_storage, forgotten = (self._cache, self._ids, self._storage == storage,
                                               self._forgotten)
        self.reset("a call given this cache failed part-way")  # handed over: kept again by keep()
        batch = sequence.shape[0]
        if steps.owns_caches:
            keep, why = 0, (f"{type(steps).__name__} owns its caches (one per shape, handed to "
                            f"the next call of that shape): nothing is kept across calls")
            cache = None
        elif ids is None:
            keep, why = 0, forgotten
        elif not same_storage:
            keep, why, cache = 0, "the model moved to another device or dtype", None
        else:
            keep, why = _shared(model, cache, ids, sequence, width, padded, capacity)
            cache = _room(model, steps, cache, batch, needed, capacity, keep)
        if cache is None:  # nothing of the old cache fits: a fresh one, as generate makes it
            keep, cache = 0, steps.new_cache(model, batch, needed)
        else:
            cache.length = keep  # positions at or past it are overwritten before they are read
        logits, next_position = steps.prefill(model, cache, sequence, real, keep, width, padded)
        self.kept, self.prefilled = keep, width - keep
        self.fallback = why if keep == 0 else None
        self._owner, self._calling = weakref.ref(model), (storage, steps.owns_caches)
        return cache, logits, next_position

    def keep(self, cache, sequence: Tensor, window: int) -> None:
        """After ``generate``'s loop: keep ``cache`` and the ids (B, S) of its positions, taken
        from ``sequence`` (B, L + N) (``window``: its first column; > 0 after a slide)."""
        storage, owned = self._calling
        if owned:
            self.reset("the last call's steps owned its cache")
        elif window:
            self.reset("the last call slid its window: its cache holds re-based positions")
        else:
            self._cache, self._ids = cache, sequence[:, :cache.length].clone()  # (B, S)
            self._storage, self._forgotten = storage, None


def _shared(model: nn.Module, cache, ids: Tensor, sequence: Tensor, width: int, padded: bool,
            capacity: int) -> tuple[int, str | None]:
    """How many of the positions of ``cache``, which holds ``ids`` (B, S), to keep (< width)
    and, where none, why."""
    if padded:
        return 0, "a left-padded batch is prefilled whole"
    if sequence.shape[0] != ids.shape[0]:
        return 0, f"the cache holds {ids.shape[0]} rows, this call has {sequence.shape[0]}"
    if cache.max_length > capacity:
        return 0, (f"the cache holds {cache.max_length} positions, more than this call's "
                   f"context of {capacity}")
    if not _cuttable(cache):
        return 0, "a layer keeps a recurrent state (linear attention) that cannot be cut back"
    switch = longrope_switch(getattr(model.config, "rope_scaling", None))
    if switch is not None and (ids.shape[1] > switch) != (width > switch):
        return 0, (f"LongRoPE: the cached keys and this prompt lie on different sides of "
                   f"the switch at {switch} positions (other factors turn them)")
    span = min(ids.shape[1], width)
    agree = (ids[:, :span] == sequence[:, :span]).all(dim=0)  # (span,): every row agrees
    shared = int(agree.long().cumprod(dim=0).sum())  # the leading run of agreement
    keep = min(shared, width - 1)  # the last prompt id is run: its logits pick a token
    if keep and not all(layer.can_rewind(keep, ids.shape[1]) for layer in cache.self_attention):
        return 0, (f"a sliding-window layer's ring has overwritten positions before {keep} that "
                   f"the rest of the prompt would read (it shares {shared} of the "
                   f"{ids.shape[1]} cached ids; a ring keeps all of them or all but the last)")
    return keep, None if keep else "the prompt shares no prefix with the cached ids"


def _storage(model: nn.Module) -> tuple:
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype


def _cuttable(cache) -> bool:
    """Every layer's cache is a ``KVCache``, indexed by position: setting ``length`` cuts it."""
    return all(isinstance(layer, KVCache) for layer in cache.self_attention)


def _room(model: nn.Module, steps, cache, batch: int, needed: int, capacity: int, keep: int
          ) -> object | None:
    """A cache of ``needed`` .. ``capacity`` positions holding the first ``keep`` of ``cache``:
    ``cache`` itself where it is big enough, else a larger one (twice its size, at most the
    capacity) with the kept positions copied over; None where ``cache`` cannot serve (another
    batch, a recurrent state, a larger capacity)."""
    if cache.batch != batch or not _cuttable(cache) or cache.max_length > capacity:
        return None
    if cache.max_length >= needed:
        return cache
    grown = steps.new_cache(model, batch, min(capacity, max(needed, 2 * cache.max_length)))
    for old, new in zip(cache.self_attention, grown.self_attention):
        new.copy_prefix(old, keep)  # (B, Hkv, K, Dh), or a sliding layer's ring
    return grown
