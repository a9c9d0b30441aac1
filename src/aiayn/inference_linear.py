"""Linear layers at inference on CPU through oneDNN, with the FFN's activation fused in.

``nn.Linear`` on CPU runs MKL's GEMM and then, for the FFN, a separate pass for the activation. With no
gradient to record (``torch.no_grad`` / ``torch.inference_mode``), large products go through oneDNN's
``linear`` instead (``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile``'s CPU backend
emits), which also applies ReLU / GELU / SiLU in the same pass over the output. Measured on the
benchmark machine (AMD EPYC, fp32, 1 thread, all-MiniLM shapes, 4096 rows): 384 -> 1152 317 -> 287 ms,
384 -> 1536 401 -> 368 ms plus the GELU pass (66 ms) saved, 1536 -> 384 413 -> 392 ms. For a few rows
(decoding) oneDNN is slower without prepacked weights, so below ``MIN_ROWS`` rows, under autograd, off
CPU, outside float32, or where the operator is missing, this is exactly ``nn.Linear``.

Results equal ``linear`` (+ activation) up to summation order (tests/test_fast_paths.py).

Legend: N rows (batch x length), I input width, O output width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

MIN_ROWS = 256  # below this, MKL's GEMM is faster than unpacked oneDNN (measured: 8-16 rows)

# activation name (aiayn.feedforward) -> oneDNN post-op (name, algorithm)
FUSED_ACTIVATIONS = {"relu": ("relu", ""), "gelu": ("gelu", "none"),
                     "gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}


def _onednn_linear():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_LINEAR_POINTWISE = _onednn_linear()
enabled = _LINEAR_POINTWISE is not None  # module switch (tests and A/B benchmarks turn it off)


def uses_onednn(x: Tensor, layer: nn.Linear) -> bool:
    """Whether ``linear`` would take the oneDNN path for input ``x`` (…, I)."""
    # Cheapest test first: a decoding step (few rows) leaves after one comparison.
    return (enabled and x.numel() >= MIN_ROWS * x.shape[-1] and not torch.is_grad_enabled()
            and x.device.type == "cpu" and x.dtype == torch.float32
            and layer.weight.dtype == torch.float32)


def linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """``layer(x)``: (…, I) -> (…, O), through oneDNN when ``uses_onednn``."""
    if uses_onednn(x, layer):
        return _LINEAR_POINTWISE(x, layer.weight, layer.bias, "none", [], "")
    return layer(x)


def linear_activation(layer: nn.Linear, x: Tensor, activation: str) -> Tensor | None:
    """``activation(layer(x))`` in one oneDNN call, or None when that path does not apply (the caller
    then runs its plain code). ``activation`` names an ``aiayn.feedforward`` activation."""
    fused = FUSED_ACTIVATIONS.get(activation)
    if fused is None or not uses_onednn(x, layer):
        return None
    return _LINEAR_POINTWISE(x, layer.weight, layer.bias, fused[0], [], fused[1])
