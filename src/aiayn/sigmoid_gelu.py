"""GPT-2's GELU (the tanh approximation) through the logistic sigmoid, for float32 on a CPU.

    gelu_tanh(x) = x/2 (1 + tanh(z)) = x sigmoid(2 z),    z = sqrt(2/pi) (x + 0.044715 x^3)

since 1 + tanh(z) = 2 sigmoid(2 z). The two are the same function; this form avoids PyTorch's CPU
``tanh``, which on AVX2 runs ~4x slower than its ``sigmoid`` or ``erf`` GELU: ``F.gelu(x,
approximate="tanh")`` took 3.6 ms and its backward 3.7 ms on (2048, 1024) floats, this module's 1.4
and 2.6 (AMD EPYC Zen 4 without AVX-512, 2 threads; see docs/performance.md, seventeenth pass). It is
also the more accurate: x/2 (1 + tanh(z)) cancels for negative x.

The derivative, with s = sigmoid(2 z):

    d gelu_tanh / dx = s + x s (1 - s) d(2z)/dx = s (1 + (1 - s) x u'),    x u' = x (2c + 6 c a x^2)

where c = sqrt(2/pi), a = 0.044715. The backward recomputes s from x (what ``F.gelu`` saves too).
Elsewhere (other dtypes, other devices, ``torch.func`` transforms) ``F.gelu`` runs. ``torch.compile``
traces this form too: the compiled LM training step was 1.014x the one with ``F.gelu`` traced
(inductor's tanh is no faster).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from aiayn import functorch_guard

enabled = True  # module switch: A/B benchmarks turn it off
TWO_C = 2 * math.sqrt(2 / math.pi)  # u = 2z = x (TWO_C + TWO_C_A x^2)
TWO_C_A = TWO_C * 0.044715
# |x u'| where s (1 - s) is not 0 in float32 (|x| < ~11.3) is below 400: clamping it here keeps an
# overflowing x u' (|x| > ~1e18) from making inf * 0 = NaN where s is exactly 0 or 1.
X_DU_LIMIT = 1e4


def applies(x: Tensor) -> bool:
    """Switched on, a plain float32 CPU tensor, no ``torch.func`` transform (the autograd.Function
    below has no rules for them)."""
    return (enabled and x.device.type == "cpu" and x.dtype == torch.float32 and type(x) is Tensor
            and not functorch_guard.transform_active())


def gelu_tanh(x: Tensor) -> Tensor:
    """``F.gelu(x, approximate="tanh")``."""
    if not applies(x):
        return F.gelu(x, approximate="tanh")
    if torch.is_grad_enabled() and x.requires_grad:
        return _SigmoidGeluTanh.apply(x)
    return _forward(x)


def gelu_tanh_(x: Tensor) -> Tensor:
    """``gelu_tanh`` overwriting ``x`` (inference: nothing saved for a backward)."""
    if not applies(x):
        return torch._C._nn.gelu_(x, approximate="tanh")
    return x.mul_(_sigmoid_2z(x))


def _sigmoid_2z(x: Tensor) -> Tensor:
    """sigmoid(2z) into a new tensor, in one allocation and in-place passes."""
    s = x * x
    s.mul_(TWO_C_A).add_(TWO_C).mul_(x)  # u = 2z
    return torch.sigmoid(s, out=s)


def _forward(x: Tensor) -> Tensor:
    return _sigmoid_2z(x).mul_(x)


class _SigmoidGeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return _forward(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        s = _sigmoid_2z(x)
        x_du = x * x
        x_du.mul_(3 * TWO_C_A).add_(TWO_C).mul_(x).clamp_(-X_DU_LIMIT, X_DU_LIMIT)
        x_du.addcmul_(x_du, s, value=-1)  # (1 - s) x u'
        torch.addcmul(s, x_du, s, out=x_du)  # s (1 + (1 - s) x u')
        return x_du.mul_(grad)
