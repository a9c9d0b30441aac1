"""LayerNorm and dropout as every block of aiayn builds and applies them (paper 3.1, 5.4).

One place decides the LayerNorm's epsilon and bias from the config, and one place skips an inactive
dropout: in eval mode (or with p = 0) the module call is pure overhead, which shows when decoding one
token at a time, where per-call overhead is most of the step (benchmarks/generation.py).
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.config import TransformerConfig


def layer_norm(config: TransformerConfig) -> nn.LayerNorm:
    """A LayerNorm over the model width with the config's epsilon and bias."""
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.layer_norm_bias)


def apply_dropout(dropout: nn.Dropout, x: Tensor) -> Tensor:
    """``dropout(x)``, without calling the module when it would return ``x`` unchanged."""
    return dropout(x) if dropout.training and dropout.p > 0 else x
