"""The LayerNorm every block of aiayn builds (paper 3.1: "LayerNorm(x + Sublayer(x))").

One place decides the epsilon and whether the norm has a bias, from the config.
"""

from __future__ import annotations

from torch import nn

from aiayn.config import TransformerConfig


def layer_norm(config: TransformerConfig) -> nn.LayerNorm:
    """A LayerNorm over the model width with the config's epsilon and bias."""
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.layer_norm_bias)
