"""Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2.

Applied to every position separately and identically; ReLU as in the paper, or the GELU variants that
BERT (erf GELU) and GPT-2 (tanh approximation) use, or SiLU (Marian).

Legend: B batch, T length, D model width, F inner width (d_ff).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import sigmoid_gelu
from aiayn.inference_linear import linear, linear_activation
from aiayn.normalisation import apply_dropout

ACTIVATION_FUNCTIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": sigmoid_gelu.gelu_tanh,  # F.gelu(x, approximate="tanh"), faster on a CPU
    "silu": F.silu,
}

# The same functions overwriting their input: at inference the product they follow is a fresh tensor,
# so the (B, T, F) activation needs no second buffer.
IN_PLACE_ACTIVATIONS = {
    "relu": torch.relu_,
    "gelu": torch._C._nn.gelu_,
    "gelu_tanh": sigmoid_gelu.gelu_tanh_,
    "silu": torch._C._nn.silu_,
}


def activation_function(name: str):
    try:
        return ACTIVATION_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of "
                         f"{sorted(ACTIVATION_FUNCTIONS)}") from None


class FeedForward(nn.Module):
    """(B, T, D) -> (B, T, D) through an inner width F."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.activation = activation_function(activation)
        self.activation_in_place = IN_PLACE_ACTIVATIONS[activation]
        self.activation_name = activation
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        # Inference on CPU: one oneDNN pass for the product and the activation (aiayn.inference_linear).
        hidden = linear_activation(self.linear1, x, self.activation_name)
        if hidden is None:
            hidden = linear(self.linear1, x)  # (B, T, F)
            # Nothing to differentiate and no hook holding the product: overwrite it in place
            # instead of allocating a second (B, T, F) buffer.
            in_place = not (torch.is_grad_enabled() or self.linear1._forward_hooks
                            or nn.modules.module._global_forward_hooks)
            hidden = self.activation_in_place(hidden) if in_place else self.activation(hidden)
        return linear(self.linear2, apply_dropout(self.dropout, hidden))
