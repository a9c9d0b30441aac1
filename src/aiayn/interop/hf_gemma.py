"""Gemma checkpoints <-> aiayn's ``CausalLM``: Gemma (``GemmaForCausalLM``, model_type "gemma"),
Gemma 2 (``Gemma2ForCausalLM``, "gemma2") and Gemma 3 text (``Gemma3ForCausalLM``,
``Gemma3TextModel``, "gemma3_text": the 270M and 1B models).

Gemma is the Llama-style decoder (rotary positions, RMSNorm, grouped-query attention, a gated FFN:
GEGLU with the tanh GELU) with embeddings times sqrt(D) (``scale_embeddings``, the paper's 3.4).
Each later generation adds, each a TransformerConfig field:

    Gemma 2: a norm on each sub-layer's output too ("sandwich")      ``sandwich_norm``
             every other layer sees a sliding window (4096 keys)      ``sliding_window``,
                                                                      ``sliding_window_layers``
             attention scores c * tanh(s / c), c = 50                 ``attention_softcap``
             (the reference kernel: SDPA cannot transform scores)     (``attention="reference"``)
             logits c * tanh(x / c), c = 30                           ``logit_softcap``
             scores times query_pre_attn_scalar^-1/2, which is not    ``attention_scale``
             Dh^-1/2 in the 27B (144 = D / H, Dh = 128)
    Gemma 3: RMSNorm on each head's q and k, no soft-capping          ``qk_norm``
             5 of every 6 layers slide (512 keys)
             sliding layers use RoPE base 10,000, the others 1e6      ``rope_local_theta``,
             (scaled for the long context of the larger models)       ``rope_theta``, ``rope_scaling``

Gemma's RMSNorm stores w and scales by 1 + w; aiayn's ``nn.RMSNorm`` stores the gain, so every norm
weight is read as 1 + w (float32, as Gemma computes it) and written back as gain - 1 (the
``plus_one`` layout). Attention scores are scaled by ``query_pre_attn_scalar``^-1/2 (Gemma 2 and
3): ``attention_scale`` holds it when it is not the head width, and export writes it back (the head
width when ``attention_scale`` is None); the multimodal ``Gemma3ForConditionalGeneration`` is
refused.

Legend: D model width, Dh head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (CONFIG_FILE, Checkpoint, NameMap, activation_from_hf,
                                     build_config, require, require_fields)
from aiayn.interop.hf_llama import LLAMA_NORMS, needs_phi3, rope_settings, token_id
from aiayn.interop.hf_llama import name_map as llama_name_map
from aiayn.models import CausalLM

MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
# transformers' default head_dim (every Gemma) and query_pre_attn_scalar (Gemma 2 and 3), for a
# config.json that leaves them out
DEFAULT_WIDTH = 256
ARCHITECTURES = {"GemmaForCausalLM": "causal_lm", "GemmaModel": "causal_lm",
                 "Gemma2ForCausalLM": "causal_lm", "Gemma2Model": "causal_lm",
                 "Gemma3ForCausalLM": "causal_lm", "Gemma3TextModel": "causal_lm"}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Generation:
    """What a Gemma generation has: its name, the class written on export, the sandwich norms,
    QK-norm, and the sliding pattern of transformers 4's configs (every ``window_pattern``-th layer
    is global; None: no window)."""

    name: str
    architecture: str
    sandwich_norm: bool
    qk_norm: bool
    window_pattern: int | None


GENERATIONS = {
    "gemma": Generation("Gemma", "GemmaForCausalLM", False, False, None),
    "gemma2": Generation("Gemma 2", "Gemma2ForCausalLM", True, False, 2),
    "gemma3_text": Generation("Gemma 3", "Gemma3ForCausalLM", True, True, 6),
}


def _rope(hf: dict[str, Any], source) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling or None, local theta) from transformers 5's nested
    ``rope_parameters`` or 4's ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    nested = hf.get("rope_parameters") or {}
    max_length = hf.get("max_position_embeddings")
    theta, scaling = rope_settings(nested.get(FULL) or hf.get("rope_scaling") or {},
                                   hf.get("rope_theta", 1_000_000.0), max_length, source)
    local_theta, local_scaling = rope_settings(nested.get(SLIDING) or {},
                                               hf.get("rope_local_base_freq", 10_000.0),
                                               max_length, source)
    if local_scaling is not None:
        raise ValueError(f"{source / CONFIG_FILE}: scaled RoPE on the sliding layers "
                         f"({local_scaling['rope_type']!r}) is not supported")
    return theta, scaling, local_theta


def _sliding_layers(hf: dict[str, Any], layers: int, pattern: int | None, source) -> list[int]:
    if pattern is None:  # Gemma: no window
        return []
    kinds = hf.get("layer_types")
    if kinds is None:  # transformers 4: every sliding_window_pattern-th layer is global
        pattern = hf.get("sliding_window_pattern", pattern)
        return [i for i in range(layers) if (i + 1) % pattern]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(f"{source / CONFIG_FILE}: layer_types must list {layers} of "
                         f"{SLIDING!r} / {FULL!r}, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == SLIDING]


def _activation(hf: dict[str, Any], source) -> str:
    """Gemma's ``hidden_activation`` (Gemma 1's configs: ``hidden_act``, whose legacy "gelu" means
    the tanh approximation, as transformers reads it)."""
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if name == "gelu" and not hf.get("hidden_activation"):
        name = "gelu_pytorch_tanh"
    return activation_from_hf(name, "hidden_activation", source)


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a Gemma, Gemma 2 or Gemma 3 text config.json (``overrides`` win)."""
    source = checkpoint.directory
    model_type = hf.get("model_type", "gemma3_text")
    generation = GENERATIONS[model_type]
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{source / CONFIG_FILE}: use_bidirectional_attention=true is not "
                         f"supported (a causal decoder)")
    if hf.get("attention_bias"):
        raise ValueError(f"{source / CONFIG_FILE}: attention_bias=true is not supported")
    d_model = require(hf, "hidden_size", source)
    heads = require(hf, "num_attention_heads", source)
    # A field the file leaves out takes transformers' default (256 for both), not D / H
    head_dim = hf.get("head_dim") or DEFAULT_WIDTH
    # Gemma 2 and 3 scale the scores by query_pre_attn_scalar^-1/2, Gemma by Dh^-1/2
    scalar = head_dim if model_type == "gemma" else hf.get("query_pre_attn_scalar", DEFAULT_WIDTH)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        raise ValueError(f"{source / CONFIG_FILE}: query_pre_attn_scalar must be a positive "
                         f"number, got {scalar!r}")
    layers = require(hf, "num_hidden_layers", source)
    vocab_size = require(hf, "vocab_size", source)
    if generation.qk_norm:  # Gemma 3: a RoPE base for each kind of layer
        theta, scaling, local_theta = _rope(hf, source)
    else:
        theta, scaling = rope_settings(hf.get("rope_parameters") or hf.get("rope_scaling") or {},
                                       hf.get("rope_theta", 10_000.0),
                                       hf.get("max_position_embeddings"), source)
        local_theta = None
    sliding = _sliding_layers(hf, layers, generation.window_pattern, source)
    window = hf.get("sliding_window") if sliding else None
    # Gemma2Config's defaults (50, 30) where config.json is silent; Gemma 3's are None
    defaults = (50.0, 30.0) if hf.get("model_type") == "gemma2" else (None, None)
    softcaps = dict(attention_softcap=hf.get("attn_logit_softcapping", defaults[0]),
                    logit_softcap=hf.get("final_logit_softcapping", defaults[1]))

    def token(name: str, default: int) -> int:
        value = token_id(hf.get(name), vocab_size)
        return default if value is None else value

    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=d_model, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_head=None if head_dim * heads == d_model else head_dim,
        d_ff=require(hf, "intermediate_size", source), n_encoder_layers=0, n_decoder_layers=layers,
        max_length=hf.get("max_position_embeddings", 32768), dropout=0.0,
        attention_dropout=hf.get("attention_dropout") or 0.0,
        attention_scale=None if scalar == head_dim else scalar ** -0.5,
        activation=_activation(hf, source), gated_ffn=True, norm="rms", norm_first=True,
        final_norm=True, sandwich_norm=generation.sandwich_norm, qk_norm=generation.qk_norm,
        layer_norm_eps=hf.get("rms_norm_eps", 1e-6), positions="rotary",
        rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta if window is not None else None, **softcaps,
        sliding_window=window,
        sliding_window_layers=None if window is None or len(sliding) == layers else sliding,
        scale_embeddings=True, embedding_norm=False, type_vocab_size=0, bias=False,
        tie_output=hf.get("tie_word_embeddings", True), output_bias=False,
        init_std=hf.get("initializer_range", 0.02), pad_id=token("pad_token_id", 0),
        embedding_padding_idx=True,  # transformers' padding_idx: the pad (GemmaConfig's 0)
        bos_id=token("bos_token_id", 2), eos_id=token("eos_token_id", 1))
    fields["decoder_start_id"] = fields["bos_id"]
    if softcaps["attention_softcap"] is not None:  # SDPA cannot soft-cap the scores
        fields["attention"] = "reference"
    fields.update(overrides)
    return build_config(fields, source)


# aiayn's norms in a layer -> Gemma 2 and 3's names: one before and one after each sub-layer
GEMMA_NORMS = {"self_attention_residual.norm": "input_layernorm",
               "self_attention_residual.post_norm": "post_attention_layernorm",
               "feedforward_residual.norm": "pre_feedforward_layernorm",
               "feedforward_residual.post_norm": "post_feedforward_layernorm"}


def name_map(config: TransformerConfig, prefix: str, *, has_head: bool) -> NameMap:
    """How a Gemma checkpoint (keys under ``prefix``: "model." or "") fills a ``CausalLM``:
    Llama's map (Gemma 2 and 3: with four norms a layer), every norm stored as w = gain - 1."""
    norms = GEMMA_NORMS if config.sandwich_norm else LLAMA_NORMS
    return llama_name_map(config, prefix, has_head=has_head, norms=norms, norm_layout="plus_one")


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    if task not in (None, "causal_lm"):
        raise ValueError(f"a Gemma checkpoint loads as 'causal_lm', not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    prefix = "model." if any(k.startswith("model.") for k in checkpoint.tensors) else ""
    return CausalLM(config), name_map(config, prefix,
                                      has_head="lm_head.weight" in checkpoint.tensors)


# --- export --------------------------------------------------------------------------------------
def _query_pre_attn_scalar(config: TransformerConfig) -> int | float:
    """Gemma 2 and 3 scale scores by query_pre_attn_scalar^-1/2: ``attention_scale``^-2 (an int
    when it is one up to rounding), or the head width when ``attention_scale`` is None."""
    if config.attention_scale is None:
        return config.head_dim
    scalar = config.attention_scale ** -2
    return round(scalar) if math.isclose(scalar, round(scalar), rel_tol=1e-9) else scalar


def generation_of(config: TransformerConfig) -> str | None:
    """The Gemma generation (``GENERATIONS`` key) an aiayn config has the layout of, or None: QK-norm
    is Gemma 3's, sandwich norms without it Gemma 2's, embeddings times sqrt(D) in a rotary RMSNorm
    decoder with GEGLU Gemma's (a SwiGLU one is left to Llama, which refuses the scaling)."""
    if config.qk_norm and config.sandwich_norm:
        return "gemma3_text"
    if config.sandwich_norm:
        return "gemma2"
    if (config.scale_embeddings and config.norm == "rms" and config.positions == "rotary"
            and config.gated_ffn and config.activation == "gelu_tanh"):
        return "gemma"
    return None


def matches(model: nn.Module) -> bool:
    return isinstance(model, CausalLM) and generation_of(model.config) is not None


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn ``CausalLM`` as ``GemmaForCausalLM``,
    ``Gemma2ForCausalLM`` or ``Gemma3ForCausalLM`` (``generation_of``)."""
    config: TransformerConfig = model.config
    model_type = generation_of(config)
    generation = GENERATIONS[model_type]
    required = dict(norm="rms", norm_first=True, final_norm=True, positions="rotary",
                    gated_ffn=True, activation="gelu_tanh", qk_norm=generation.qk_norm,
                    bias=False, qkv_bias=None, scale_embeddings=True, embedding_norm=False,
                    type_vocab_size=0, output_bias=False, relative_attention_buckets=0,
                    scale_attention=True, scale_output=False, first_attention_norm=True)
    if model_type == "gemma3_text":
        required.update(attention_softcap=None, logit_softcap=None)
    if model_type == "gemma":  # Gemma's scores are always scaled by Dh^-1/2
        required.update(attention_softcap=None, logit_softcap=None, sliding_window=None,
                        attention_scale=None)
    require_fields(config, required, generation.name, subject="it")
    if needs_phi3(config):
        raise ValueError(f"cannot export as {generation.name}: it turns whole heads without "
                         f"LongRoPE; the model has rotary_fraction={config.rotary_fraction!r}, "
                         f"rope_scaling={config.rope_scaling!r}")
    n = config.n_decoder_layers
    sliding = set(range(n) if config.sliding_window_layers is None
                  else config.sliding_window_layers) if config.sliding_window else set()
    hf = dict(model_type=model_type, architectures=[generation.architecture],
              vocab_size=config.vocab_size, hidden_size=config.d_model,
              intermediate_size=config.d_ff, num_hidden_layers=n,
              num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
              head_dim=config.head_dim, hidden_activation="gelu_pytorch_tanh",
              hidden_act="gelu_pytorch_tanh", max_position_embeddings=config.max_length,
              rms_norm_eps=config.layer_norm_eps, tie_word_embeddings=config.tie_output,
              attention_bias=False, attention_dropout=config.attention_dropout,
              initializer_range=config.init_std or 0.02, bos_token_id=config.bos_id,
              eos_token_id=config.eos_id, pad_token_id=config.pad_id)
    rope = {"rope_type": "default", **(config.rope_scaling or {}),
            "rope_theta": float(config.rope_theta)}
    if model_type == "gemma":
        hf.update(rope_parameters=rope, rope_theta=float(config.rope_theta),
                  rope_scaling=config.rope_scaling)
    else:
        hf.update(query_pre_attn_scalar=_query_pre_attn_scalar(config),
                  sliding_window=config.sliding_window or config.max_length,
                  layer_types=[SLIDING if i in sliding else FULL for i in range(n)],
                  final_logit_softcapping=config.logit_softcap,
                  attn_logit_softcapping=config.attention_softcap)
    if model_type == "gemma2":
        if config.rope_local_theta is not None:
            raise ValueError("cannot export as Gemma 2: its layers share one RoPE base; the model "
                             f"has rope_local_theta={config.rope_local_theta!r}")
        hf.update(rope_parameters=rope, rope_theta=float(config.rope_theta),
                  rope_scaling=config.rope_scaling)
    if model_type == "gemma3_text":
        local_theta = config.rope_local_theta or config.rope_theta
        if sliding and config.rope_local_theta is None and config.rope_scaling is not None:
            raise ValueError("cannot export as Gemma 3: its sliding layers' RoPE is never scaled; "
                             "set rope_local_theta")
        hf["rope_parameters"] = {FULL: rope, SLIDING: {"rope_type": "default",
                                                       "rope_theta": float(local_theta)}}
    return hf, name_map(config, "model.", has_head=True)
