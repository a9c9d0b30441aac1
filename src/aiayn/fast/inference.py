"""Decoding with compiled steps: ``prepare_for_inference`` and the ``InferenceEngine`` it returns.

Decoding runs the model once per token on a handful of rows, so a step is dozens of small operators
and their Python dispatch. ``torch.compile`` turns the one-token step into one graph (the approach of
pytorch-labs/gpt-fast): the prefill and the search logic stay eager, each later step is compiled.
The engine holds no copy of any weight: a compiled graph reads the model's parameters when it runs,
so weights changed after preparing (in place, through ``.data``, by ``load_state_dict``) are used
as they are, and two engines in one process can hold different options.

On a CUDA device, a decoder-only model's generation replays each step from a CUDA graph
(``aiayn.fast.cuda_graphs``): fixed shapes, one launch per token; an encoder-decoder's beam search
does the same with the whole step, search included (``aiayn.fast.graphed_beam``), and its greedy
search is that search with one beam.

Where compiling fails (no C++ compiler for inductor's CPU code, an unsupported platform), the engine
warns once and runs the plain step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from aiayn.decoding.beam import beam_search
from aiayn.decoding.generation import Generation, GenerationConfig, Steps, decode_step, generate
from aiayn.decoding.greedy import Hypothesis, check_encoder_decoder, decoder_step, greedy_search
from aiayn.fast.cuda_graphs import GraphedSteps, slot_step
from aiayn.fast.graphed_beam import GraphedBeam, beam_slot_step

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")
GRAPHED_KERNELS = ("fused", "reference")  # exact over any mask: a step may attend to every slot


@dataclass(frozen=True, kw_only=True)
class InferenceOptions:
    """How an ``InferenceEngine`` runs decoding steps.

    Fields:
        compile: run every step after the prompt's through ``torch.compile`` (dynamic shapes: one
            graph serves every batch size and length; the first call compiles, seconds). None:
            on a CUDA model only (on the CPU compiled steps run 1.2-1.5x faster once warm, but
            compiling takes longer than a short generation runs; docs/performance.md).
        mode: ``torch.compile``'s mode (None: its default); a mode asks for compiled steps
            (with ``compile=None``, on the CPU too; with ``compile=False``, an error).
        cuda_graphs: on a CUDA device, decoder-only generation and encoder-decoder searches
            replay fixed-shape steps from CUDA graphs (one per batch size and cache capacity, and
            for beam search per source length, captured on first use; the 8 most recently used
            shapes are kept).
    """

    compile: bool | None = None
    mode: str | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True, False or None, got {self.compile!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"mode must be one of {list(COMPILE_MODES)}, got {self.mode!r}")
        if self.mode is not None and self.compile is False:
            raise ValueError(f"mode={self.mode!r} is torch.compile's mode, and compile=False runs "
                             f"the steps uncompiled: give one or the other")


class CompiledStep:
    """``torch.compile(function)``, or ``function`` itself once compiling has failed (warned once)."""

    def __init__(self, function: Callable, options: InferenceOptions, *,
                 dynamic: bool | None = True):
        self.plain = function
        self.compiled = torch.compile(function, dynamic=dynamic, mode=options.mode)
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.plain(*args)
        try:
            return self.compiled(*args)
        except (ValueError, TypeError, IndexError):
            raise  # the caller's mistake: the plain step would raise it too
        except Exception as error:  # noqa: BLE001 - any compiler failure means "run eagerly"
            self.failed = True
            warnings.warn(f"aiayn: torch.compile failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); decoding runs "
                          f"uncompiled", RuntimeWarning, stacklevel=2)
            return self.plain(*args)


class InferenceEngine:
    """A model prepared for decoding (see ``prepare_for_inference``).

    Attributes:
        model: the plain model, unchanged.
        options: the ``InferenceOptions`` it was prepared with.
        decoder_step: the encoder-decoder step (``aiayn.decoding.greedy.decoder_step``'s signature).
        decode_step: the decoder-only step (``aiayn.decoding.generation.decode_step``'s signature).
    """

    def __init__(self, model: nn.Module, options: InferenceOptions):
        self.model, self.options = model, options
        self.compiles = options.compile if options.compile is not None else (
            options.mode is not None or next(model.parameters()).device.type == "cuda")
        if self.compiles:
            self.decoder_step: Callable = CompiledStep(decoder_step, options)
            self.decode_step: Callable = CompiledStep(decode_step, options)
        else:
            self.decoder_step, self.decode_step = decoder_step, decode_step
        self._graphed: GraphedSteps | None = None
        self._graphed_beam: GraphedBeam | bool | None = None  # False: plain beam search

    def uses_cuda_graphs(self) -> bool:
        """Whether ``generate`` replays CUDA graphs: asked for, a CUDA model, an exact kernel and
        no relative position bias."""
        device = next(self.model.parameters()).device
        config = self.model.config
        return (self.options.cuda_graphs and device.type == "cuda"
                and getattr(config, "attention", None) in GRAPHED_KERNELS
                and not getattr(config, "relative_attention_buckets", 0))  # T5's bias: no slots

    def generation_steps(self) -> Steps:
        """The ``Steps`` ``generate`` runs: CUDA graphs where ``uses_cuda_graphs``, else calls of
        ``decode_step``."""
        if not self.uses_cuda_graphs():
            return Steps(self.decode_step)
        if self._graphed is None:
            step = (CompiledStep(slot_step, self.options, dynamic=False) if self.compiles
                    else slot_step)
            self._graphed = GraphedSteps(step, use_graph=True)
        return self._graphed

    def generate(self, prompt_ids: Tensor | Sequence[Sequence[int]] | Sequence[int],
                 config: GenerationConfig | None = None, **kwargs) -> Generation:
        """``aiayn.decoding.generation.generate`` on this engine's steps."""
        return generate(self.model, prompt_ids, config, steps=self.generation_steps(), **kwargs)

    def greedy_search(self, source: Tensor, source_mask: Tensor, **kwargs) -> list[Hypothesis]:
        """``aiayn.decoding.greedy.greedy_search`` on this engine's steps; where the beam search
        replays CUDA graphs (``beam_search``), the same search as a one-beam search without a
        length penalty, which is greedy search (the same tokens and scores:
        tests/test_fast_inference.py), replayed from them."""
        check_encoder_decoder(self.model, "greedy_search")  # before choosing a graphed search
        graphed = self._graphed_search()
        if graphed:
            run = self._run_graphed(graphed, source, source_mask, beam_size=1, alpha=0.0, **kwargs)
            if run is not None:
                return run
        return greedy_search(self.model, source, source_mask, step=self.decoder_step, **kwargs)

    def beam_search(self, source: Tensor, source_mask: Tensor, **kwargs) -> list[Hypothesis]:
        """``aiayn.decoding.beam.beam_search`` on this engine's steps; where ``uses_cuda_graphs``
        and the model takes fixed-shape steps (``GraphedBeam.supports``: not T5), the same search
        replayed from CUDA graphs."""
        check_encoder_decoder(self.model, "beam_search")  # before choosing a graphed search
        graphed = self._graphed_search()
        if graphed:
            run = self._run_graphed(graphed, source, source_mask, **kwargs)
            if run is not None:
                return run
        return beam_search(self.model, source, source_mask, step=self.decoder_step, **kwargs)

    def _graphed_search(self) -> GraphedBeam | bool:
        """The fixed-shape search the encoder-decoder searches replay (False: none here)."""
        if self._graphed_beam is None:
            self._graphed_beam = False
            if self.uses_cuda_graphs() and GraphedBeam.supports(self.model):
                # dynamic: one compiled step serves every batch of a file (a graph per shape)
                step = (CompiledStep(beam_slot_step, self.options, dynamic=True)
                        if self.compiles else beam_slot_step)
                self._graphed_beam = GraphedBeam(step, use_graph=True)
        return self._graphed_beam

    def _run_graphed(self, graphed: GraphedBeam, source: Tensor, source_mask: Tensor,
                     **kwargs) -> list[Hypothesis] | None:
        """The graphed search's hypotheses; None (and a warning, once) where capturing fails."""
        try:
            return graphed(self.model, source, source_mask, **kwargs)
        except (ValueError, TypeError, IndexError):
            raise  # the caller's mistake: the plain search would raise it too
        except RuntimeError as error:  # capturing failed on this GPU / PyTorch: go on plainly
            self._graphed_beam = False
            warnings.warn(f"aiayn: the CUDA-graph beam search failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0] if str(error) else ''}); searches run "
                          f"without graphs", RuntimeWarning, stacklevel=3)
            return None


def prepare_for_inference(model: nn.Module, options: InferenceOptions | None = None
                          ) -> InferenceEngine:
    """An ``InferenceEngine`` for ``model`` (put in eval mode) with ``options`` (default: compiled
    steps and CUDA graphs on a GPU, plain steps on the CPU). Move the model to its device first.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` with a ``config``.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"prepare_for_inference needs an aiayn model, got {type(model).__name__}")
    model.eval()
    return InferenceEngine(model, options or InferenceOptions())
