"""Large float32 products through oneDNN on CPUs where it beats MKL, for training and inference.

PyTorch multiplies float32 matrices on CPU with MKL (``nn.Linear``, ``torch.mm``). On an AMD EPYC Zen 4
(AVX-512; 2 threads; 2026-11-24) oneDNN's ``linear`` (``torch.ops.mkldnn._linear_pointwise``, the
kernel ``torch.compile``'s CPU backend emits) ran the products of a Transformer 1-25 % faster: the
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
bias gradients through MKL (without autograd, optionally with the FFN's activation applied in the
same pass). ``matmul_transposed`` / ``matmul`` are the two oneDNN-friendly products the chunked loss
needs. While ``torch.compile`` traces they are custom operators (``aiayn::onednn_linear``,
``aiayn::onednn_matmul``), so compiled graphs keep them instead of falling back to MKL; eager calls
skip the operator dispatch. Results equal MKL's up to summation order (tests/test_onednn_linear.py).

``applies`` keeps the plain path off CPU, outside float32, under autocast, for tensor subclasses
(FSDP's DTensor) and below MIN_ROWS rows (decoding steps have their own paths,
``aiayn.inference_linear``).

Legend: N rows, I input width, O output width.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Below this, MKL's GEMM is as fast or faster than unpacked oneDNN. Measured on the Zen 4 (2 threads,
# docs/performance.md, ninth pass): at 64-192 rows oneDNN won on most Transformer shapes of widths
# 256-768 (1.02-1.36x; square (D, D) products 0.90-1.09x), whole encoder forwards at 100-192 rows
# 1.06-1.09x, training steps at 64 / 128 / 192 rows 1.02x / 1.09x / 1.09x; at 8-48 rows the (D, D)
# products lost (0.62-0.84x).
MIN_ROWS = 64


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
    plain CPU float32 tensors, no autocast."""
    return (enabled and x.numel() >= MIN_ROWS * x.shape[-1]
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and type(x) in PLAIN_TYPES and type(weight) in PLAIN_TYPES
            and not torch.is_autocast_enabled("cpu"))


# Plain tensors: a subclass (FSDP's DTensor, a fake or functional tensor) keeps the plain path.
PLAIN_TYPES = (Tensor, torch.nn.Parameter)


# The oneDNN products as custom operators: ``torch.compile`` then calls them as opaque kernels (its
# own lowering of ``mkldnn._linear_pointwise`` expects prepacked, frozen weights) and still fuses the
# element-wise work around them; eager autograd uses the formula registered below.
POST_OPS = {"none": ("none", ""), "relu": ("relu", ""), "gelu": ("gelu", "none"),
            "gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}  # aiayn activation -> oneDNN


def _product(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "none") -> Tensor:
    """The oneDNN call itself: activation(x @ weight.T + bias), (…, I) -> (…, O)."""
    post_op, algorithm = POST_OPS[activation]
    return LINEAR_POINTWISE(x, weight, bias, post_op, [], algorithm)


def _eager_matmul(a: Tensor, b: Tensor) -> Tensor:
    return _product(a, b.t(), None)  # b.T: a view oneDNN reads in place


@torch.library.custom_op("aiayn::onednn_linear", mutates_args=(),
                         schema="(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor")
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    return _product(x, weight, bias, activation)


@_linear_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("aiayn::onednn_matmul", mutates_args=(),
                         schema="(Tensor a, Tensor b) -> Tensor")
def _matmul_op(a: Tensor, b: Tensor) -> Tensor:
    return _eager_matmul(a, b)


@_matmul_op.register_fake
def _(a, b):
    return a.new_empty(*a.shape[:-1], b.shape[1])


def _save_for_backward(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    if activation != "none":  # the activation's backward would need the product: never fused then
        raise RuntimeError("aiayn::onednn_linear is differentiable only without a fused activation")
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _gradients(ctx, grad: Tensor, matmul_op) -> tuple:
    """The gradients of x, weight and bias of ``F.linear``, from the saved x and weight."""
    x, weight = ctx.saved_tensors
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = matmul_op(grad, weight)  # (…, O) x (O, I) -> (…, I)
    if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
        flat_grad = grad.reshape(-1, grad.shape[-1])  # (N, O)
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.t().mm(x.reshape(-1, x.shape[-1]))  # (O, N) x (N, I): MKL
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(dim=0)  # (O,)
    return grad_x, grad_weight, grad_bias


_linear_op.register_autograd(lambda ctx, grad: (*_gradients(ctx, grad, _matmul_op), None),
                             setup_context=_save_for_backward)


class _EagerLinear(torch.autograd.Function):
    """The same product and gradients as ``aiayn::onednn_linear`` without the custom operator's
    dispatch, which cost eager training steps 0.6-1 % (A/B in one process)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)  # (…, O)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        return _gradients(ctx, grad, _eager_matmul)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
           activation: str = "none") -> Tensor:
    """``activation(F.linear(x, weight, bias))``: (…, I) -> (…, O); differentiable without an
    activation (forward and input gradient through oneDNN, weight and bias gradients through MKL).
    Call it where ``applies``."""
    if torch.compiler.is_compiling():
        return _linear_op(x, weight, bias, activation)
    if activation == "none" and torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _EagerLinear.apply(x, weight, bias)
    return _product(x, weight, bias, activation)


def matmul_transposed(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b.T (+ bias)``: (N, I) x (O, I) -> (N, O), no autograd."""
    if torch.compiler.is_compiling():
        return _linear_op(a, b, bias, "none")
    return _product(a, b, bias)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``: (N, O) x (O, I) -> (N, I), no autograd."""
    return _matmul_op(a, b) if torch.compiler.is_compiling() else _eager_matmul(a, b)
