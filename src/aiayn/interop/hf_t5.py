"""T5 checkpoints (``T5ForConditionalGeneration``, ``T5Model``) <-> aiayn's encoder-decoder ``Transformer``.

T5 (Raffel et al. 2020) is the paper's encoder-decoder with, each a TransformerConfig field
(docs/t5.md): RMSNorm ("T5LayerNorm": ``norm="rms"``), pre-norm with a final norm, no biases, no
embedding scale, no absolute positions but a relative position bias (``relative_attention_buckets``,
``relative_attention_max_distance``), unscaled attention scores (``scale_attention=False``: the
1/sqrt(d_k) is folded into the initialisation), one embedding shared by encoder, decoder and (1.0)
the output projection, which then sees the hidden states times d_model^-0.5 (``scale_output``).

    T5 1.0 (feed_forward_proj "relu")           T5 1.1 (feed_forward_proj "gated-gelu")
    FFN wo(relu(wi x))                          wo(gelu_tanh(wi_0 x) * wi_1 x)  (``gated_ffn``)
    output projection tied, scaled              output projection of its own, unscaled

transformers 5 reads ``tie_word_embeddings=false`` as "no rescaling" and keeps the head tied unless
the checkpoint holds a different ``lm_head.weight``; aiayn reads a checkpoint the same way.
HF's separate q, k, v (and the cross-attention's k, v) are concatenated into aiayn's fused
projections, or kept apart with ``fused_projections=False``.

Legend: D model width, F feed-forward width, V vocabulary, H heads, Dh head width (d_kv).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, CONFIG_FILE, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models import Transformer

MODEL_TYPES = ("t5",)
ARCHITECTURES = {"T5ForConditionalGeneration": "seq2seq", "T5Model": "seq2seq"}


def _feedforward(hf: dict[str, Any], source) -> tuple[bool, str]:
    """(gated, aiayn activation) of ``feed_forward_proj``: "relu", "gated-gelu", "gated-silu", ..."""
    kind = hf.get("feed_forward_proj", "relu")
    parts = kind.split("-") if isinstance(kind, str) else []
    if not 1 <= len(parts) <= 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(f"{source / CONFIG_FILE}: feed_forward_proj={kind!r} is not supported; "
                         f"use 'ACT' or 'gated-ACT' (e.g. 'relu', 'gated-gelu')")
    name = "gelu_new" if kind == "gated-gelu" else parts[-1]  # as HF's T5Config maps it
    return len(parts) == 2, activation_from_hf(name, "feed_forward_proj", source)


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a T5 config.json (``overrides`` win)."""
    source = checkpoint.directory
    vocab_size = require(hf, "vocab_size", source)
    d_model = require(hf, "d_model", source)
    heads = require(hf, "num_heads", source)
    d_kv = hf.get("d_kv") or d_model // heads
    layers = require(hf, "num_layers", source)
    gated, activation = _feedforward(hf, source)
    tied = hf.get("tie_word_embeddings", True)
    pad = hf.get("pad_token_id", 0)
    pad = pad if isinstance(pad, int) else 0
    eos = hf.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    start = hf.get("decoder_start_token_id")
    start = start if isinstance(start, int) else pad
    dropout = hf.get("dropout_rate", 0.1)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, src_vocab_size=vocab_size, tie_source_target=True,
        d_model=d_model, n_heads=heads, d_head=None if d_kv * heads == d_model else d_kv,
        d_ff=require(hf, "d_ff", source), n_encoder_layers=layers,
        n_decoder_layers=hf.get("num_decoder_layers") or layers,
        max_length=hf.get("n_positions") or 512, dropout=dropout, attention_dropout=dropout,
        activation_dropout=dropout, activation=activation, gated_ffn=gated, norm="rms",
        norm_first=True, final_norm=True, layer_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        bias=False, positions="none", scale_embeddings=False, embedding_norm=False,
        type_vocab_size=0,
        relative_attention_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        scale_attention=False, scale_output=bool(hf.get("scale_decoder_outputs", tied)),
        tie_output=bool(tied), output_bias=False, init_std=None, pad_id=pad, bos_id=start,
        eos_id=eos, decoder_start_id=start)
    fields.update(overrides)
    return build_config(fields, source)


def _attention(ours: str, hf: str, *, cross: bool, fused: bool, n: int) -> list[Rule]:
    q, k, v, o = (f"{hf}{name}.weight" for name in "qkvo")
    if fused and not cross:
        rules = [Rule(f"{ours}qkv_proj.weight", (q, k, v), n)]
    elif fused:
        rules = [Rule(f"{ours}q_proj.weight", (q,), n), Rule(f"{ours}kv_proj.weight", (k, v), n)]
    else:
        rules = [Rule(f"{ours}{name}_proj.weight", (key,), n)
                 for name, key in (("q", q), ("k", k), ("v", v))]
    return rules + [Rule(f"{ours}out_proj.weight", (o,), n)]


def _feedforward_rules(config: TransformerConfig, ours: str, hf: str, n: int) -> list[Rule]:
    names = ((("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo")) if config.gated_ffn
             else (("linear1", "wi"), ("linear2", "wo")))
    return [Rule(f"{ours}feedforward.{a}.weight", (f"{hf}DenseReluDense.{b}.weight",), n)
            for a, b in names]


def _stack(config: TransformerConfig, side: str) -> list[Rule]:
    """One stack's rules: T5 numbers a block's sub-layers, layer.0 self-attention, (decoder) layer.1
    cross-attention, then the feed-forward; each has its own layer_norm."""
    n = config.n_encoder_layers if side == "encoder" else config.n_decoder_layers
    ours, hf = f"{side}.layers.{{}}.", f"{side}.block.{{}}.layer."
    fused = config.fused_projections
    rules = _attention(f"{ours}self_attention.", f"{hf}0.SelfAttention.", cross=False, fused=fused,
                       n=n)
    residual = "attention_residual" if side == "encoder" else "self_attention_residual"
    rules.append(Rule(f"{ours}{residual}.norm.weight", (f"{hf}0.layer_norm.weight",), n))
    ffn = 1
    if side == "decoder":
        rules += _attention(f"{ours}cross_attention.", f"{hf}1.EncDecAttention.", cross=True,
                            fused=fused, n=n)
        rules.append(Rule(f"{ours}cross_attention_residual.norm.weight",
                          (f"{hf}1.layer_norm.weight",), n))
        ffn = 2
    rules += _feedforward_rules(config, ours, f"{hf}{ffn}.", n)
    rules.append(Rule(f"{ours}feedforward_residual.norm.weight", (f"{hf}{ffn}.layer_norm.weight",),
                      n))
    # the first block's table serves the whole stack (RelativePositionBias, computed once)
    rules += [Rule(f"{side}.position_bias.embedding.weight",
                   (f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
              Rule(f"{side}.norm.weight", (f"{side}.final_layer_norm.weight",))]
    return rules


def name_map(config: TransformerConfig, *, has_head: bool) -> NameMap:
    """How a T5 checkpoint fills a ``Transformer`` (one shared embedding, the head tied or not)."""
    rules = _stack(config, "encoder") + _stack(config, "decoder")
    rules.append(Rule("encoder.embeddings.tokens.weight", ("shared.weight",)))
    group = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    new = []
    if config.tie_output:
        group += ("lm_head.weight",)
    elif has_head:
        rules.append(Rule("generator.weight", ("lm_head.weight",)))
    else:
        new.append("generator.weight")
    # Some checkpoints carry an unused table in the first cross-attention (HF ignores it too).
    ignore = [re.escape("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")]
    return NameMap(rules, ties=[group], ignore=ignore, new=new)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    if task not in (None, "seq2seq"):
        raise ValueError(f"a T5 checkpoint loads as 'seq2seq', not task={task!r}")
    tensors = checkpoint.tensors
    has_head = "lm_head.weight" in tensors
    if has_head and "shared.weight" in tensors and not torch.equal(tensors["lm_head.weight"],
                                                                   tensors["shared.weight"]):
        overrides = {"tie_output": False, **overrides}  # a head of its own, whatever the config says
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    return Transformer(config), name_map(config, has_head=has_head)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, Transformer) and model.config.relative_attention_buckets > 0


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn ``Transformer`` as
    ``T5ForConditionalGeneration``."""
    config: TransformerConfig = model.config
    required = dict(norm="rms", norm_first=True, final_norm=True, bias=False, positions="none",
                    scale_embeddings=False, embedding_norm=False, type_vocab_size=0,
                    scale_attention=False, tie_source_target=True, output_bias=False,
                    attention_dropout=config.dropout, activation_dropout=config.dropout,
                    sliding_window=None, first_attention_norm=True, qk_norm=False,
                    sandwich_norm=False, attention_softcap=None, logit_softcap=None)
    require_fields(config, required, "T5")
    if config.kv_heads != config.n_heads:
        raise ValueError(f"cannot export as T5: T5 has one key/value head per query head, the model "
                         f"has n_kv_heads={config.n_kv_heads}")
    if config.scale_output and not config.tie_output:
        raise ValueError("cannot export as T5: T5 rescales the output (scale_output) only with the "
                         "head tied to the embedding (tie_output)")
    activation = AIAYN_ACTIVATIONS[config.activation]
    if config.gated_ffn:  # T5Config reads "gated-gelu" as the tanh GELU: the exact one by name
        activation = {"gelu_tanh": "gated-gelu", "gelu": "gated-gelu_python"}.get(
            config.activation, f"gated-{activation}")
    hf = dict(model_type="t5", architectures=["T5ForConditionalGeneration"],
              vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.head_dim,
              d_ff=config.d_ff, num_layers=config.n_encoder_layers,
              num_decoder_layers=config.n_decoder_layers, num_heads=config.n_heads,
              relative_attention_num_buckets=config.relative_attention_buckets,
              relative_attention_max_distance=config.relative_attention_max_distance,
              dropout_rate=config.dropout, layer_norm_epsilon=config.layer_norm_eps,
              feed_forward_proj=activation, is_encoder_decoder=True,
              # transformers reads tie_word_embeddings as "tie and rescale": False writes the
              # head as lm_head.weight and no rescaling (a head equal to shared loads tied again)
              tie_word_embeddings=config.scale_output, scale_decoder_outputs=config.scale_output,
              pad_token_id=config.pad_id, eos_token_id=config.eos_id,
              decoder_start_token_id=config.decoder_start_id, n_positions=config.max_length)
    return hf, name_map(config.replace(tie_output=config.scale_output), has_head=True)

