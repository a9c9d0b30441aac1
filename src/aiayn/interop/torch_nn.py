"""Copy the weights of PyTorch's own ``nn.Transformer`` / ``nn.TransformerEncoder`` /
``nn.TransformerDecoder`` into aiayn's stacks, through an explicit parameter-name map.

``torch.nn`` has no embeddings or output projection, so only the stacks (layers and final norms) are
copied; every source key must be used and every target parameter filled, with equal shapes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.nn.stacks import Decoder, Encoder


def config_from_torch(module: nn.Module, **overrides: Any) -> TransformerConfig:
    """The aiayn config whose stacks match a ``torch.nn`` transformer module."""
    if isinstance(module, nn.Transformer):
        encoder_layers, decoder_layers = module.encoder.layers, module.decoder.layers
        final = module.encoder.norm is not None
    elif isinstance(module, nn.TransformerEncoder):
        encoder_layers, decoder_layers, final = module.layers, [], module.norm is not None
    elif isinstance(module, nn.TransformerDecoder):
        encoder_layers, decoder_layers, final = [], module.layers, module.norm is not None
    else:
        raise TypeError(f"expected nn.Transformer, nn.TransformerEncoder or nn.TransformerDecoder, "
                        f"got {type(module).__name__}")
    layer = (list(encoder_layers) + list(decoder_layers))[0]
    activation = layer.activation
    names = {nn.functional.relu: "relu", nn.functional.gelu: "gelu"}
    if isinstance(activation, nn.ReLU):
        activation_name = "relu"
    elif isinstance(activation, nn.GELU) and activation.approximate == "none":
        activation_name = "gelu"
    elif activation in names:
        activation_name = names[activation]
    else:
        raise ValueError(f"unsupported activation {activation!r} in the torch.nn model")
    fields = dict(d_model=layer.self_attn.embed_dim, n_heads=layer.self_attn.num_heads,
                  d_ff=layer.linear1.out_features, n_encoder_layers=len(encoder_layers),
                  n_decoder_layers=len(decoder_layers), norm_first=layer.norm_first,
                  final_norm=final, layer_norm_eps=layer.norm1.eps, activation=activation_name,
                  dropout=layer.dropout.p, bias=layer.linear1.bias is not None)
    return TransformerConfig(**{**fields, **overrides})


def _attention_map(source: str, target: str, *, cross: bool, fused: bool, d_model: int
                   ) -> dict[str, tuple[str, slice]]:
    """target name -> (source name, rows) for one nn.MultiheadAttention (packed q, k, v rows)."""
    q, k, v, kv = slice(0, d_model), slice(d_model, 2 * d_model), slice(2 * d_model, 3 * d_model), \
        slice(d_model, 3 * d_model)
    everything = slice(None)
    mapping: dict[str, tuple[str, slice]] = {}
    for kind in ("weight", "bias"):
        packed = f"{source}.in_proj_{kind}"
        if fused and not cross:
            mapping[f"{target}.qkv_proj.{kind}"] = (packed, everything)
        elif fused:
            mapping[f"{target}.q_proj.{kind}"] = (packed, q)
            mapping[f"{target}.kv_proj.{kind}"] = (packed, kv)
        else:
            for name, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                mapping[f"{target}.{name}.{kind}"] = (packed, rows)
        mapping[f"{target}.out_proj.{kind}"] = (f"{source}.out_proj.{kind}", everything)
    return mapping


def _layer_map(index: int, *, decoder: bool, fused: bool, d_model: int
               ) -> dict[str, tuple[str, slice]]:
    source, target = f"layers.{index}", f"layers.{index}"
    everything = slice(None)
    mapping = _attention_map(f"{source}.self_attn", f"{target}.self_attention", cross=False,
                             fused=fused, d_model=d_model)
    norms = [("norm1", "attention_residual")] if not decoder else [
        ("norm1", "self_attention_residual"), ("norm2", "cross_attention_residual")]
    norms.append(("norm3" if decoder else "norm2", "feedforward_residual"))
    if decoder:
        mapping.update(_attention_map(f"{source}.multihead_attn", f"{target}.cross_attention",
                                      cross=True, fused=fused, d_model=d_model))
    for kind in ("weight", "bias"):
        for linear in ("linear1", "linear2"):
            mapping[f"{target}.feedforward.{linear}.{kind}"] = (f"{source}.{linear}.{kind}",
                                                               everything)
        for source_norm, residual in norms:
            mapping[f"{target}.{residual}.norm.{kind}"] = (f"{source}.{source_norm}.{kind}",
                                                           everything)
    return mapping


def _copy(source: nn.Module, target: nn.Module, *, decoder: bool) -> None:
    config_layers = len(target.layers)
    first = target.layers[0].self_attention
    mapping: dict[str, tuple[str, slice]] = {}
    for index in range(config_layers):
        mapping.update(_layer_map(index, decoder=decoder, fused=first.fused_projections,
                                  d_model=first.d_model))
    if target.norm is not None:
        for kind in ("weight", "bias"):
            mapping[f"norm.{kind}"] = (f"norm.{kind}", slice(None))
    source_state = source.state_dict()
    target_params = {name: p for name, p in target.named_parameters()
                     if not name.startswith("embeddings.")}
    unused = set(source_state) - {name for name, _ in mapping.values()}
    if unused:
        raise ValueError(f"torch.nn weights not used by the aiayn model: {sorted(unused)}")
    unfilled = set(target_params) - set(mapping)
    if unfilled:
        raise ValueError(f"aiayn parameters with no torch.nn source: {sorted(unfilled)}")
    with torch.no_grad():
        for name, (source_name, rows) in mapping.items():
            if source_name not in source_state:
                raise ValueError(f"torch.nn state has no {source_name!r} (needed for {name!r})")
            value: Tensor = source_state[source_name][rows]
            if value.shape != target_params[name].shape:
                raise ValueError(f"shape mismatch for {name!r}: aiayn {tuple(target_params[name].shape)}"
                                 f" vs torch.nn {source_name!r} {tuple(value.shape)}")
            target_params[name].copy_(value)


def load_torch_encoder(source: nn.TransformerEncoder, target: Encoder) -> None:
    """Copy an ``nn.TransformerEncoder``'s layers (and final norm) into an aiayn ``Encoder``."""
    _copy(source, target, decoder=False)


def load_torch_decoder(source: nn.TransformerDecoder, target: Decoder) -> None:
    """Copy an ``nn.TransformerDecoder``'s layers (and final norm) into an aiayn ``Decoder``."""
    _copy(source, target, decoder=True)


def load_torch_transformer(source: nn.Transformer, target: nn.Module) -> None:
    """Copy an ``nn.Transformer`` into an aiayn ``Transformer`` (its encoder and decoder stacks)."""
    load_torch_encoder(source.encoder, target.encoder)
    load_torch_decoder(source.decoder, target.decoder)
