"""Large float32 products through oneDNN on CPUs where it beats MKL, for training and inference.

PyTorch multiplies float32 matrices on CPU with MKL (``nn.Linear``, ``torch.mm``). On an AMD EPYC Zen 4
(AVX-512; 2 threads; 2026-11-24) oneDNN's ``linear`` (``torch.ops.mkldnn._linear_pointwise``, the
kernel ``torch.compile``'s CPU backend emits) ran the products of a Transformer 10-20 % faster: the
all-MiniLM encoder's 4096 x 384 -> 1152 / 384 / 1536 and 4096 x 1536 -> 384 at 207-220 GFLOP/s against
MKL's 182-194, a training step's (N, O) x (O, I) input gradient likewise, and the loss's
1024 x 256 -> 8192 logits at 140 against 110. The weight gradient (O, N) x (N, I), whose first operand
is a transposed view, went the other way (oneDNN 91-130 GFLOP/s, MKL 175-195), so it stays with MKL.
On an AMD EPYC Zen 3 (AVX2) oneDNN lost by 13-24 % (docs/performance.md, fifth pass), on a Zen 1 (AVX2)
it won by 4-8 %. Where it wins is a property of the CPU, so the default is decided by the CPU, not by
timing it in each process (a timing choice would make results depend on the machine's load):
``enabled`` is true where PyTorch runs AVX-512 kernels. Intel AVX-512 CPUs fall under the same rule
without having been measured here; set ``enabled`` either way to choose.

``linear`` is ``F.linear`` with that split: forward and input gradient through oneDNN, weight and
bias gradients through MKL. ``matmul_transposed`` / ``matmul`` are the two oneDNN-friendly products
the chunked loss needs. Results equal MKL's up to summation order (tests/test_onednn_linear.py).

``applies`` keeps the plain path off CPU, outside float32, under autocast, while ``torch.compile``
traces (inductor chooses its own kernels), for tensor subclasses (FSDP's DTensor) and below MIN_ROWS
rows (decoding steps have their own paths, ``aiayn.inference_linear``).

Legend: N rows, I input width, O output width.
"""

from __future__ import annotations

import torch
from torch import Tensor

MIN_ROWS = 256  # below this, MKL's GEMM is faster than unpacked oneDNN (measured: 8-16 rows)


def _linear_pointwise():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


LINEAR_POINTWISE = _linear_pointwise()


def prefers_onednn() -> bool:
    """Whether this CPU is one where oneDNN's products are the default: oneDNN present and PyTorch
    running AVX-512 kernels (see the module docstring)."""
    return LINEAR_POINTWISE is not None and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


enabled = prefers_onednn()  # module switch: tests and A/B benchmarks set it


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight, ...)`` goes through oneDNN: switched on, at least MIN_ROWS rows of
    plain CPU float32 tensors, no autocast, not being traced by ``torch.compile``."""
    return (enabled and x.numel() >= MIN_ROWS * x.shape[-1]
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and type(x) in _PLAIN and type(weight) in _PLAIN
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling())


_PLAIN = (Tensor, torch.nn.Parameter)


def matmul_transposed(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b.T (+ bias)``: (N, I) x (O, I) -> (N, O), no autograd."""
    return LINEAR_POINTWISE(a, b, bias, "none", [], "")


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``: (N, O) x (O, I) -> (N, I), no autograd; ``b.T`` is a view oneDNN reads in place."""
    return LINEAR_POINTWISE(a, b.t(), None, "none", [], "")


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return LINEAR_POINTWISE(x, weight, bias, "none", [], "")  # (…, O)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul(grad, weight)  # (…, O) x (O, I) -> (…, I)
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            flat_grad = grad.reshape(-1, grad.shape[-1])  # (N, O)
            if ctx.needs_input_grad[1]:
                grad_weight = flat_grad.t().mm(x.reshape(-1, x.shape[-1]))  # (O, N) x (N, I): MKL
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = flat_grad.sum(dim=0)  # (O,)
        return grad_x, grad_weight, grad_bias


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: (…, I) -> (…, O), differentiable; call it where ``applies``."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return LINEAR_POINTWISE(x, weight, bias, "none", [], "")
