"""Decoder-only generation from CUDA graphs: one launch per token instead of hundreds.

A decoding step of a small model on a GPU is bound by launching its kernels and by Python, not by the
GPU (GPT-2 small reads ~250 MB of weights a token, well under a millisecond of an H100's bandwidth).
``GraphedSteps`` runs each step at fixed shapes, the approach of pytorch-labs/gpt-fast: the token is
written to cache slot ``column`` (``slots``), it attends over every slot of a cache allocated once
per (batch, capacity), and a (B, C) mask says which slots hold keys. Fixed shapes and fixed addresses
let the step (compiled or not) be captured once in a ``torch.cuda.CUDAGraph`` and replayed: each
token then costs a few small copies into the graph's input buffers and one replay. The prompt's
prefill runs as usual (variable length), into the same cache.

On a CPU the same fixed-shape steps run as plain calls (no graph): that is how the tests check them.

Legend: B batch, C cache capacity (slots), V vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from aiayn.decoding.generation import Steps


def storage_key(model: nn.Module) -> tuple:
    """Where and how the model's parameters and buffers are stored. A captured graph reads those
    addresses: after ``.to(dtype)``, a move, or ``p.data = new_tensor`` the key changes and the
    graphs are captured again (in-place updates keep the key, and the graphs see them)."""
    return tuple((t.data_ptr(), t.dtype, t.device)
                 for t in (*model.parameters(), *model.buffers()))


def capture(run: Callable[[], Tensor], prepare: Callable[[], None] = lambda: None
            ) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """``run()`` captured in a CUDA graph: a few runs on a side stream first (CUDA graphs need
    warmed-up libraries and, for a compiled step, the compiled code), each after ``prepare()``,
    then the capture. Returns the graph and the output tensor that each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            prepare()
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        output = run()
    return graph, output


def use_shape(shapes: dict, key: tuple, model: nn.Module, make: Callable[[], object],
              limit: int):
    """``shapes[key]``, made by ``make()`` when absent or captured for another ``storage_key``; the
    ``limit`` most recently used shapes are kept (each holds a cache and a graph's memory)."""
    entry = shapes.pop(key, None)
    if entry is None or entry.storage != storage_key(model):
        while len(shapes) >= limit:  # the least recently used goes
            shapes.pop(next(iter(shapes)))
        entry = make()
    shapes[key] = entry  # now the most recently used
    return entry


def slot_step(model: nn.Module, ids: Tensor, padding_mask: Tensor, positions: Tensor, cache,
              slots: Tensor) -> Tensor:
    """Logits (B, V) of a fixed-shape step: ``ids`` (B, 1) at cache slot ``slots`` (1,)."""
    return model(ids, padding_mask=padding_mask, positions=positions, cache=cache,
                 slots=slots)[:, -1]


class FixedStep:
    """One (batch, capacity) shape: the cache, the step's input buffers and, on CUDA, its graph."""

    def __init__(self, model: nn.Module, batch: int, capacity: int, step: Callable,
                 use_graph: bool):
        device = next(model.parameters()).device
        self.cache = model.new_cache(batch, capacity)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.step = step
        self.storage = storage_key(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        if use_graph:
            self._capture(model)

    def _run(self, model: nn.Module) -> Tensor:
        return self.step(model, self.ids, self.mask, self.positions, self.cache, self.slots)

    def _capture(self, model: nn.Module) -> None:
        # What the warm-up runs write into the cache is overwritten by the next prefill.
        self.graph, self.logits = capture(lambda: self._run(model))

    def __call__(self, model: nn.Module) -> Tensor:
        if self.graph is None:
            return self._run(model)
        self.graph.replay()
        return self.logits


class GraphedSteps(Steps):
    """``generate``'s steps at fixed shapes (see the module docstring), one ``FixedStep`` per
    (batch, capacity), the ``max_shapes`` most recently used kept.

    Args:
        step: ``slot_step`` or a compiled version of it.
        use_graph: capture and replay CUDA graphs (needs the model on a CUDA device).
        max_shapes: how many shapes' caches and graphs to keep.
    """

    owns_caches = True  # a later call of the same shape reuses the cache: no PrefixCache keeps it

    def __init__(self, step: Callable = slot_step, *, use_graph: bool = True,
                 max_shapes: int = 8):
        super().__init__()
        self.fixed_step, self.use_graph, self.max_shapes = step, use_graph, max_shapes
        self.shapes: dict[tuple[int, int], FixedStep] = {}
        self.current: FixedStep | None = None

    def new_cache(self, model: nn.Module, batch: int, capacity: int):
        self.current = use_shape(
            self.shapes, (batch, capacity), model,
            lambda: FixedStep(model, batch, capacity, self.fixed_step, self.use_graph),
            self.max_shapes)
        self.current.cache.length = 0  # the prefill writes from slot 0 again
        return self.current.cache

    def prefill(self, model: nn.Module, cache, sequence: Tensor, real: Tensor, start: int,
                end: int, padded: bool) -> tuple[Tensor, Tensor | None]:
        logits, next_position = super().prefill(model, cache, sequence, real, start, end, padded)
        fixed = self.current
        fixed.mask.zero_()
        fixed.mask[:, :end - start] = real[:, start:end]  # the prompt's real columns
        return logits, next_position

    def next(self, model: nn.Module, cache, sequence: Tensor, real: Tensor, window: int,
             column: int, positions: Tensor | None) -> Tensor:
        fixed = self.current
        slot = column - window
        fixed.ids.copy_(sequence[:, column:column + 1])
        fixed.mask[:, slot] = True
        if positions is None:  # unpadded rows: the position is the slot
            fixed.positions.fill_(slot)
        else:
            fixed.positions.copy_(positions)
        fixed.slots.fill_(slot)
        cache.length = slot + 1  # host-side count only: the fixed step neither reads nor moves it
        return fixed(model)
