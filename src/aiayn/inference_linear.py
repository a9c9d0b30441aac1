"""Linear layers at inference on CPU through oneDNN, with the FFN's activation fused in.

``nn.Linear`` on CPU runs MKL's GEMM and then, for the FFN, a separate pass for the activation. With no
gradient to record (``torch.no_grad`` / ``torch.inference_mode``), large products go through oneDNN's
``linear`` instead (``torch.ops.mkldnn._linear_pointwise``, the kernel ``torch.compile``'s CPU backend
emits), which also applies ReLU / GELU / SiLU in the same pass over the output. Measured on the
benchmark machine (AMD EPYC, fp32, 1 thread, all-MiniLM shapes, 4096 rows): 384 -> 1152 317 -> 287 ms,
384 -> 1536 401 -> 368 ms plus the GELU pass (66 ms) saved, 1536 -> 384 413 -> 392 ms. For a few rows
(decoding) oneDNN is slower without prepacked weights, so below ``MIN_ROWS`` rows, under autograd, off
CPU, outside float32, or where the operator is missing, this is exactly ``nn.Linear``.

Decoding steps multiply a handful of rows (batch x beams) by the same weights step after step. There
``small_rows_linear`` keeps a derived copy of a vocabulary-sized weight (the output projection),
made once and reused while the weight is unchanged (``PackedWeights``): for one row the transposed
(I, O) matrix, which MKL reads as a plain GEMV operand instead of repacking the (O, I) matrix on every
call (measured, 1 thread, AMD EPYC: the 256 -> 8192 output projection 3.2 -> 1.5 ms a row), and for
2..64 rows oneDNN's prepacked (blocked) weight (``torch.ops.mkldnn._reorder_linear_weight``):
256 -> 8192 at 8 rows 8.4 -> 4.1 ms, at 16 rows 10.6 -> 4.7 ms. The layers' own (D, 3D), (D, F)...
matrices are left to ``linear``: the transposed copy measured 3-6 % slower there in whole decoding
runs (their GEMVs are bound by reading the weights, whatever the layout). A derived copy is rebuilt
whenever its weight changes: in-place updates (an optimizer step, ``load_state_dict``, ``copy_``) bump
the weight's version counter, ``.to()`` / ``.data = ...`` change its storage, and the cache checks both
on every call.

Results equal ``linear`` (+ activation) up to summation order (tests/test_fast_paths.py,
tests/test_packed_weights.py).

Legend: N rows (batch x length), I input width, O output width.
"""

from __future__ import annotations

import weakref

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


# --- derived weights for decoding steps (few rows) -------------------------------------------------
SMALL_ROWS = 64  # decoding steps: batch x beams rows at most
PACKED_MIN_OUTPUTS = 4096  # oneDNN's packed weight pays off for vocabulary-sized outputs only
small_rows_enabled = True  # module switch (tests and A/B benchmarks turn it off)


def _onednn_reorder():
    try:
        return torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None


_REORDER = _onednn_reorder() if _LINEAR_POINTWISE is not None else None


class PackedWeights:
    """Derived layouts of weights, rebuilt when their weight changes.

    An entry is keyed by the weight object and layout name and remembers the weight's storage (kept
    alive, so no other tensor can take its address while the entry exists), data pointer, version
    counter, shape, dtype and device; any difference rebuilds it. Entries go when their weight is
    garbage collected.
    """

    def __init__(self):
        self._entries: dict[tuple[int, str], tuple] = {}

    def get(self, weight: Tensor, layout: str, build) -> Tensor:
        key = (id(weight), layout)
        entry = self._entries.get(key)
        if entry is not None:
            ref, storage, pointer, version, shape, dtype, device, derived = entry
            if (ref() is weight and pointer == weight.data_ptr() and version == weight._version
                    and shape == weight.shape and dtype == weight.dtype and device == weight.device):
                return derived
        with torch.no_grad():
            derived = build(weight.detach())
        ref = weakref.ref(weight, lambda _, key=key: self._entries.pop(key, None))
        self._entries[key] = (ref, weight.untyped_storage(), weight.data_ptr(), weight._version,
                              weight.shape, weight.dtype, weight.device, derived)
        return derived

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


packed_weights = PackedWeights()


def _transposed(weight: Tensor) -> Tensor:
    return weight.t().contiguous()  # (I, O)


def uses_small_rows(x: Tensor, weight: Tensor) -> bool:
    """Whether ``small_rows_linear`` applies: no autograd, CPU float32, a vocabulary-sized output (at
    least PACKED_MIN_OUTPUTS), and one row, or 2..SMALL_ROWS rows where oneDNN is present."""
    if not small_rows_enabled or torch.is_grad_enabled() or weight.shape[0] < PACKED_MIN_OUTPUTS:
        return False
    rows = x.numel() // x.shape[-1]
    return ((rows == 1 or (1 < rows <= SMALL_ROWS and _REORDER is not None))
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and not torch.compiler.is_compiling())


def small_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a decoding step's few rows x (…, I) -> (…, O), through a
    derived weight kept in ``packed_weights`` (see the module docstring). Call it only where
    ``uses_small_rows`` holds."""
    if x.numel() == x.shape[-1]:  # one row
        flat = x.reshape(1, x.shape[-1])  # (1, I)
        transposed = packed_weights.get(weight, "transposed", _transposed)  # (I, O)
        out = torch.mm(flat, transposed) if bias is None else torch.addmm(bias, flat, transposed)
        return out.view(*x.shape[:-1], weight.shape[0])  # (…, O)
    packed = packed_weights.get(weight, "onednn", _REORDER)
    return _LINEAR_POINTWISE(x, packed, bias, "none", [], "")
