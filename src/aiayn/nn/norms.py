"""The normalisation every block of aiayn builds (paper 3.1: "LayerNorm(x + Sublayer(x))").

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * g + b      (Ba et al. 2016; the paper)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * g                   (Zhang & Sennrich 2019)

RMSNorm drops the re-centring and the bias: Zhang & Sennrich found the re-scaling alone carries
LayerNorm's benefit at less cost. T5 ("T5LayerNorm") and Llama use it. One place decides the kind,
the epsilon and whether a LayerNorm has a bias, from the config.

Legend: D model width.
"""

from __future__ import annotations

from torch import nn

from aiayn.config import TransformerConfig


def layer_norm(config: TransformerConfig, width: int | None = None) -> nn.LayerNorm | nn.RMSNorm:
    """The config's layer normalisation over the model width D (or ``width``: QK-norm's Dh):
    ``nn.LayerNorm`` (``norm="layer"``, with the config's epsilon and bias) or ``nn.RMSNorm``
    (``norm="rms"``, a gain only)."""
    width = config.d_model if width is None else width
    if config.norm == "rms":
        return nn.RMSNorm(width, eps=config.layer_norm_eps)
    return nn.LayerNorm(width, eps=config.layer_norm_eps, bias=config.layer_norm_bias)
