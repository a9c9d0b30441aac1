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

    What ``compile`` does under DDP / FSDP, whose wrappers own the model's call; identical layers
    share compiled code.
    """
    layers = transformer_layers(module)
    if not layers:
        raise ValueError("compile: the model has no encoder/decoder layers")
    for layer in layers:
        layer.compile()
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
