"""What is applied to each encoder/decoder layer of a model: activation checkpointing and
``torch.compile``, in place (parameter names and checkpoints are unchanged). ``Parallel.wrap``
applies them around DDP/FSDP; the layers are also FSDP's sharding units."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def transformer_layers(module: nn.Module) -> list[nn.Module]:
    """The encoder/decoder layers of an aiayn model (the units of checkpointing and sharding)."""
    from aiayn.nn.layers import DecoderLayer, EncoderLayer

    return [m for m in module.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]


def compile_layers(module: nn.Module) -> int:
    """``torch.compile`` each encoder/decoder layer in place (regional compilation); return how many.

    Not the whole model: a compiled model call returns the logits, so the task losses would have to
    take that call and lose the chunked output projection + loss (``aiayn.training.
    linear_cross_entropy``), which never builds the (N, V) logits. Measured (``python3
    benchmarks/run_all.py --compile``, AMD EPYC Zen 4, 2 threads, medians of three runs): the
    compiled whole model 1.12x HF GPT-2's training step, the compiled layers 1.29x (the eager step
    1.31x). Identical layers share compiled code. In float32 CPU training the attention runs between
    two graphs of a layer (``aiayn.nn.attention.gemm_attention.attention_between_graphs``, one graph
    break a layer): 1.016-1.066x the step with SDPA traced into one graph, at the same compile time
    (15-16 s for the first two steps of the benchmark's model with an empty inductor cache).
    """
    from aiayn.nn.stacks import Encoder

    layers = transformer_layers(module)
    if not layers:
        raise ValueError("compile: the model has no encoder/decoder layers")
    for layer in layers:
        layer.compile()
    for encoder in module.modules():
        if isinstance(encoder, Encoder):  # packed lengths vary per batch: one recompile each
            encoder.skips_padding = False
    return len(layers)


def apply_activation_checkpointing(module: nn.Module) -> int:
    """Recompute each layer's activations in the backward pass instead of storing them.

    Trades about one extra forward per layer for activation memory that no longer grows with the
    number of layers. The layer's ``forward`` is replaced in place (parameter names are unchanged,
    so checkpoints stay compatible); dropout masks are replayed exactly (RNG state preserved), so
    loss and gradients equal the plain run's. Inference (no grad, or with a KV cache) runs the plain
    forward. Returns the number of layers wrapped.
    """
    from torch.utils.checkpoint import checkpoint

    layers = transformer_layers(module)
    for layer in layers:
        plain = layer.forward

        def forward(*args: Any, _plain=plain, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or kwargs.get("cache") is not None:
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    return len(layers)
