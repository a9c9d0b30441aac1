"""Beam search at fixed shapes, replayed from a CUDA graph: one launch and one small read a token.

``aiayn.decoding.beam.beam_search`` lets done sentences leave the batch and runs its bookkeeping
(log-softmax, the 2K best extensions, gathering the surviving beams' cache rows and histories)
eagerly between steps, with several reads back to the host a step. On a GPU a step of a small model
is bound by those launches and reads, not by the GPU (the same reason as ``cuda_graphs.py``).

``GraphedBeam`` runs the same search with every tensor at a fixed shape and address, so that all
of a token's device work is one function, captured once per shape in a ``torch.cuda.CUDAGraph``
and replayed:

1. gather the self-attention cache rows of the beams the last step kept (in place, all slots);
2. the decoder step for token t at cache slot t (``Decoder.forward``'s ``slots``), attending to
   slots 0..t and to the source's cross-attention keys/values, kept once per sentence;
3. log-softmax, the blocked ids, the </s>-only rule at each sentence's length limit
   (``force_eos``) and the choice of the 2K best extensions and K live beams (``extend``): the
   functions ``beam_search`` itself runs;
4. one small report (the </s> extensions among the first K, the kept beams, tokens and best live
   score) that the host copies back: the step's only read.

Done sentences keep their rows (they still run; the host ignores them), so no shape ever changes.
The host applies ``beam_search``'s rules to each report (finished hypotheses scored by log P / lp,
``sentence_done``) and rebuilds token histories from back-pointers. Rows never interact, so the
search is ``beam_search``'s: the same hypotheses, scores equal up to float rounding of the
different batch shapes. The first step (which projects the source into the cache) runs eagerly,
with any ``forced`` tokens fed after the start symbol (a target language code), as ``beam_search``
feeds them; a search's start symbol and blocked ids are written into the state, so a call's
``start`` needs no other graph.

On a CPU, or with ``use_graph=False``, the fixed-shape steps run as plain calls: that is how the
tests check them.

Legend: B sentences, K beams, C cache capacity (slots), S source length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from aiayn.decoding.beam import (best_hypothesis, check_beam_options, extend, force_eos,
                                 length_penalty, sentence_done)
from aiayn.decoding.greedy import (Hypothesis, blocked_tokens, check_encoder_decoder, first_tokens,
                                   output_limits)
from aiayn.fast.cuda_graphs import capture, storage_key, use_shape
from aiayn.nn.attention.cache import DecoderCache, KVCache


class BeamState:
    """The tensors one step reads and writes, for one (B, K, C, S) shape: the cache, its inputs and
    the search's state. A fixed-shape step changes them only in place."""

    def __init__(self, model: nn.Module, sources: int, beam_size: int, capacity: int,
                 source_length: int):
        config = model.config
        reference = model.decoder.embeddings.tokens.weight
        device = reference.device
        rows = sources * beam_size
        self.beam_size = beam_size
        self.cache = model.new_cache(rows, capacity, rows_per_memory=beam_size)
        # Cross-attention keys/values at fixed addresses: each search copies its own into them.
        self.memory = [(torch.zeros(shape, device=device, dtype=reference.dtype),
                        torch.zeros(shape, device=device, dtype=reference.dtype))
                       for shape in ((sources, layer.cross_attention.n_kv_heads, source_length,
                                      layer.cross_attention.head_dim)
                                     for layer in model.decoder.layers)]
        self.use_memory_buffers()
        self.memory_mask = torch.ones(sources, source_length, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)  # (B*K, 1) token t
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)  # (B*K, 1) t
        self.slots = torch.zeros(1, dtype=torch.long, device=device)  # (1,) t
        self.slot_ids = torch.arange(capacity, device=device)  # (C,)
        self.limits = torch.zeros(rows, dtype=torch.long, device=device)  # (B*K,) per sentence
        self.scores = torch.zeros(sources, beam_size, device=device)  # (B, K) the live beams'
        self.rows = torch.arange(rows, device=device)  # (B*K,) the rows the last step kept
        self.offsets = torch.arange(sources, device=device).unsqueeze(1) * beam_size  # (B, 1)
        self.blocked = torch.zeros(config.vocab_size, dtype=torch.bool, device=device)  # (V,)
        self.eos = config.eos_id

    def use_memory_buffers(self) -> None:
        """Point the cache's cross-attention at the fixed buffers (what the graph reads)."""
        for layer, (keys, values) in zip(self.cache.cross, self.memory):
            layer.keys, layer.values = keys, values

    def start(self, model: nn.Module, memory: Tensor, source_mask: Tensor, limits: Tensor,
              forced: list[int], start: int | None) -> Tensor:
        """Tokens 0..F of a new search (the start symbol, then the F ``forced`` tokens) eagerly (it
        projects ``memory`` (B, S, D) into the cache); returns the report of output position F."""
        K = self.beam_size
        self.memory_mask.copy_(source_mask)
        self.limits.copy_(limits.repeat_interleave(K))
        self.scores.fill_(-torch.inf)
        self.scores[:, 0] = 0.0  # only beam 0 is real at the start; the others would duplicate it
        self.blocked.zero_()
        self.blocked[blocked_tokens(model, start)] = True
        self.positions.fill_(len(forced))  # the output position the report chooses
        self.slots.fill_(len(forced))
        self.cache.length = 0
        for layer in self.cache.cross:  # projected again from this search's memory
            layer.keys = layer.values = None
        tokens = first_tokens(model, len(self.tokens), forced, memory.device, start)  # (B*K, 1+F)
        logits = model.decode(tokens, memory, memory_padding_mask=self.memory_mask,
                              cache=self.cache)[:, -1]  # (B*K, V)
        for layer, (keys, values) in zip(self.cache.cross, self.memory):
            keys.copy_(layer.keys)
            values.copy_(layer.values)
        self.use_memory_buffers()
        return choose(self, logits)


def choose(state: BeamState, logits: Tensor) -> Tensor:
    """From token t's logits (B*K, V): the next beams, tokens and scores written into ``state``
    (t advances); returns the report (B, 5K + 1), float32: the first K extensions' scores, beams
    and whether they end with </s>, then the K kept beams and their tokens, then the best live
    score."""
    K = state.beam_size
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # (B*K, V)
    log_probs = log_probs.masked_fill(state.blocked, -torch.inf)
    log_probs = force_eos(log_probs, state.limits <= state.positions[:, 0] + 1, state.eos)
    chosen = extend(log_probs, state.scores, state.eos)
    state.scores.copy_(chosen.scores)
    state.rows.copy_((chosen.beams + state.offsets).view(-1))  # (B*K,)
    state.tokens.copy_(chosen.tokens.view(-1, 1))
    state.positions.add_(1)
    state.slots.add_(1)
    return torch.cat([chosen.top_scores[:, :K], chosen.top_beam[:, :K].float(),
                      (chosen.top_token[:, :K] == state.eos).float(), chosen.beams.float(),
                      chosen.tokens.float(), chosen.scores[:, :1]], dim=1)  # (B, 5K + 1)


def beam_slot_step(model: nn.Module, state: BeamState, cache: DecoderCache) -> Tensor:
    """One token of the search at fixed shapes (steps 1-4 of the module docstring); the report."""
    for layer in cache.self_attention:  # the kept beams' keys/values, every slot, in place
        layer.keys.copy_(layer.keys.index_select(0, state.rows))
        layer.values.copy_(layer.values.index_select(0, state.rows))
    keys_held = state.slot_ids.unsqueeze(0) <= state.positions  # (B*K, C): slots 0..t
    hidden = model.decoder(state.tokens, None, padding_mask=keys_held,
                           memory_padding_mask=state.memory_mask, cache=cache,
                           positions=state.positions, slots=state.slots)[0]  # (B*K, 1, D)
    return choose(state, model.generator(hidden)[:, -1])


class FixedBeam:
    """One shape's ``BeamState`` and, on CUDA, the graph of its step."""

    def __init__(self, model: nn.Module, state: BeamState, step: Callable, use_graph: bool):
        self.state, self.step = state, step
        self.storage = storage_key(model)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.report: Tensor | None = None
        if use_graph:  # what the warm-up runs write is reset by the next search's ``start``
            def rewind() -> None:  # each warm-up run writes slot 0, within any capacity
                state.positions.zero_()
                state.slots.zero_()

            self.graph, self.report = capture(lambda: self.step(model, state, state.cache),
                                              rewind)

    def __call__(self, model: nn.Module) -> Tensor:
        if self.graph is None:
            return self.step(model, self.state, self.state.cache)
        self.graph.replay()
        return self.report


class GraphedBeam:
    """``beam_search`` at fixed shapes (see the module docstring), one ``FixedBeam`` per
    (B, K, C, S), the ``max_shapes`` most recently used kept (translating a file meets many
    shapes; each holds a cache and a graph's memory).

    Args:
        step: ``beam_slot_step`` or a compiled version of it.
        use_graph: capture and replay CUDA graphs (needs the model on a CUDA device).
        max_shapes: how many shapes' states and graphs to keep.
    """

    def __init__(self, step: Callable = beam_slot_step, *, use_graph: bool = True,
                 max_shapes: int = 8):
        self.step, self.use_graph, self.max_shapes = step, use_graph, max_shapes
        self.shapes: dict[tuple[int, int, int, int], FixedBeam] = {}

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """An encoder-decoder whose decoder takes fixed-shape steps: softmax attention with a
        ``KVCache``, no relative position bias (T5's needs contiguous positions), and ids that the
        float32 report holds exactly (V < 2^24)."""
        decoder = getattr(model, "decoder", None)
        return bool(getattr(decoder, "cross_attention", False) and decoder.position_bias is None
                    and model.config.vocab_size < 2 ** 24
                    and all(isinstance(cache, KVCache)
                            for cache in model.new_cache(1, 1).self_attention))

    @torch.no_grad()
    def __call__(self, model: nn.Module, source: Tensor, source_mask: Tensor, *,
                 beam_size: int = 4, alpha: float = 0.6, max_extra: int = 50,
                 forced: Sequence[int] = (), start: int | None = None) -> list[Hypothesis]:
        """``beam_search(model, source, source_mask, ...)``'s hypotheses (same arguments). A model
        moved, cast or given new parameter tensors since a shape's graph was captured gets a new
        one (``storage_key``)."""
        check_encoder_decoder(model, "GraphedBeam")
        config = model.config
        check_beam_options(beam_size, alpha, config.vocab_size)
        K, forced = beam_size, list(forced)
        first_tokens(model, 1, forced, "cpu", start)  # bad ids: refused before any work
        limits_all = output_limits(source_mask, max_extra=max_extra,
                                   model_max_length=config.position_limit)  # (B,)
        limits_all = limits_all.clamp(min=len(forced) + 1)  # room for the forced tokens and </s>
        sources, source_length = source_mask.shape
        steps = int(limits_all.max())
        limits = limits_all.tolist()

        def make() -> FixedBeam:
            if not self.supports(model):
                raise ValueError("GraphedBeam needs an encoder-decoder with softmax attention and "
                                 "no relative position bias; use aiayn.decoding.beam.beam_search")
            with torch.inference_mode(False):  # plain tensors: usable in and out of inference mode
                state = BeamState(model, sources, K, steps, source_length)
            return FixedBeam(model, state, self.step, self.use_graph)

        fixed = use_shape(self.shapes, (sources, K, steps, source_length), model, make,
                          self.max_shapes)
        memory = model.encode(source, source_mask)  # (B, S, D)
        report = fixed.state.start(model, memory, source_mask, limits_all, forced, start)
        finished: list[list[Hypothesis]] = [[] for _ in range(sources)]
        done = [False] * sources
        parents: list[np.ndarray] = []  # per step t: (B*K,) the row each kept beam came from
        tokens: list[np.ndarray] = []  # per step t: (B*K,) the token it added
        offsets = np.arange(sources)[:, None] * K  # (B, 1)

        def history(row: int, steps_done: int) -> list[int]:
            """The tokens of ``row`` after ``steps_done`` steps, from the back-pointers."""
            sequence = []
            for t in range(steps_done - 1, -1, -1):
                sequence.append(int(tokens[t][row]))
                row = int(parents[t][row])
            return sequence[::-1]

        for position in range(len(forced), steps):  # position: of the output token chosen
            if position > len(forced):
                report = fixed(model)
            values = report.cpu().numpy()  # (B, 5K + 1): the step's only read
            top_scores, top_beam, is_eos = values[:, :K], values[:, K:2 * K], values[:, 2 * K:3 * K]
            beams, chosen, best_live = values[:, 3 * K:4 * K], values[:, 4 * K:5 * K], values[:, -1]
            penalty = length_penalty(position + 1, alpha)  # tokens including </s>
            running = ~np.array(done)  # (B,)
            # </s> among the first K candidates (fairseq's rule), of the sentences still running
            ends = (is_eos > 0) & np.isfinite(top_scores) & running[:, None]  # (B, K)
            for index, column in zip(*map(np.ndarray.tolist, np.nonzero(ends))):
                row = index * K + int(top_beam[index, column])
                finished[index].append(Hypothesis(
                    history(row, position - len(forced)),
                    float(top_scores[index, column]) / penalty))
            for index in np.flatnonzero(running).tolist():
                done[index] = sentence_done(finished[index], limits[index], position,
                                            float(best_live[index]), K, alpha)
            if all(done):
                break
            parents.append((beams.astype(np.int64) + offsets).reshape(-1))
            tokens.append(chosen.astype(np.int64).reshape(-1))
        return [best_hypothesis(hypotheses) for hypotheses in finished]
