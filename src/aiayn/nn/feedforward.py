"""Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2.

Applied to every position separately and identically; ReLU as in the paper, or the GELU variants that
BERT (erf GELU) and GPT-2 (tanh approximation) use, or SiLU (Marian).

The gated variant (Shazeer 2020, "GLU variants improve Transformer"; Dauphin et al. 2017's gated
linear unit) multiplies the activated projection by a second, linear one:

    FFN_gated(x) = W_down (act(x W_gate) * (x W_up))

with SiLU it is SwiGLU (Llama, Mistral), with the tanh GELU GEGLU (T5 v1.1's "gated-gelu"). Three
matrices instead of two: at the same parameter count F shrinks by 2/3 (Llama: F = 8D/3).

Legend: B batch, T length, D model width, F inner width (d_ff).
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATION_FUNCTIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def activation_function(name: str):
    """The elementwise function called ``name`` (one of ``ACTIVATION_FUNCTIONS``)."""
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
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.activation(self.linear1(x))  # (B, T, F)
        return self.linear2(self.dropout(hidden))  # (B, T, D)


class GatedFeedForward(nn.Module):
    """(B, T, D) -> (B, T, D): ``down(act(gate(x)) * up(x))`` through an inner width F."""

    def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu", dropout: float = 0.0,
                 bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.activation = activation_function(activation)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.activation(self.gate_proj(x)) * self.up_proj(x)  # (B, T, F)
        return self.down_proj(self.dropout(hidden))  # (B, T, D)
