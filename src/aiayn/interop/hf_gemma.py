"""Gemma 3 text checkpoints (``Gemma3ForCausalLM``, ``Gemma3TextModel``; model_type "gemma3_text",
the 270M and 1B models) <-> aiayn's ``CausalLM``.

Gemma 3 is the Llama-style decoder (rotary positions, RMSNorm, grouped-query attention, a gated FFN:
GEGLU with the tanh GELU) with these differences, each a TransformerConfig field:

    embeddings times sqrt(D)                                ``scale_embeddings`` (the paper's 3.4)
    a norm on each sub-layer's output too ("sandwich")      ``sandwich_norm``
    RMSNorm on each head's q and k                          ``qk_norm``
    5 of every 6 layers see a sliding window (512 keys)     ``sliding_window``,
                                                            ``sliding_window_layers``
    sliding layers use RoPE base 10,000, the others 1e6     ``rope_local_theta``, ``rope_theta``
    (scaled for the long context of the larger models)      ``rope_scaling`` (global layers only)

Gemma's RMSNorm stores w and scales by 1 + w; aiayn's ``nn.RMSNorm`` stores the gain, so every norm
weight is read as 1 + w (float32, as Gemma computes it) and written back as gain - 1 (the
``plus_one`` layout). Attention scores are scaled by ``query_pre_attn_scalar``^-1/2, which must
equal the head width (it does in the released text models); logit soft-capping (Gemma 2) and the
multimodal ``Gemma3ForConditionalGeneration`` are refused.

Legend: D model width, Dh head width.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (CONFIG_FILE, Checkpoint, NameMap, activation_from_hf,
                                     build_config, require)
from aiayn.interop.hf_llama import name_map as llama_name_map
from aiayn.interop.hf_llama import rope_settings, token_id
from aiayn.models import CausalLM

MODEL_TYPES = ("gemma3_text",)
ARCHITECTURES = {"Gemma3ForCausalLM": "causal_lm", "Gemma3TextModel": "causal_lm"}
SLIDING, FULL = "sliding_attention", "full_attention"


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


def _sliding_layers(hf: dict[str, Any], layers: int, source) -> list[int]:
    kinds = hf.get("layer_types")
    if kinds is None:  # transformers 4: every sliding_window_pattern-th layer is global
        pattern = hf.get("sliding_window_pattern", 6)
        return [i for i in range(layers) if (i + 1) % pattern]
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {SLIDING, FULL}:
        raise ValueError(f"{source / CONFIG_FILE}: layer_types must list {layers} of "
                         f"{SLIDING!r} / {FULL!r}, got {kinds!r}")
    return [i for i, kind in enumerate(kinds) if kind == SLIDING]


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a Gemma 3 text config.json (``overrides`` win)."""
    source = checkpoint.directory
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise ValueError(f"{source / CONFIG_FILE}: {name}={hf[name]!r} is not supported "
                             f"(aiayn has no logit soft-capping)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{source / CONFIG_FILE}: use_bidirectional_attention=true is not "
                         f"supported (a causal decoder)")
    if hf.get("attention_bias"):
        raise ValueError(f"{source / CONFIG_FILE}: attention_bias=true is not supported")
    d_model = require(hf, "hidden_size", source)
    heads = require(hf, "num_attention_heads", source)
    head_dim = hf.get("head_dim") or d_model // heads
    if hf.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise ValueError(f"{source / CONFIG_FILE}: query_pre_attn_scalar="
                         f"{hf['query_pre_attn_scalar']!r} is not supported (aiayn scales the "
                         f"scores by the head width, head_dim={head_dim})")
    layers = require(hf, "num_hidden_layers", source)
    vocab_size = require(hf, "vocab_size", source)
    theta, scaling, local_theta = _rope(hf, source)
    sliding = _sliding_layers(hf, layers, source)
    window = hf.get("sliding_window") if sliding else None

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
        activation=activation_from_hf(hf.get("hidden_activation", "gelu_pytorch_tanh"),
                                      "hidden_activation", source),
        gated_ffn=True, norm="rms", norm_first=True, final_norm=True, sandwich_norm=True,
        qk_norm=True, layer_norm_eps=hf.get("rms_norm_eps", 1e-6), positions="rotary",
        rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta if window is not None else None,
        sliding_window=window,
        sliding_window_layers=None if window is None or len(sliding) == layers else sliding,
        scale_embeddings=True, embedding_norm=False, type_vocab_size=0, bias=False,
        tie_output=hf.get("tie_word_embeddings", True), output_bias=False,
        init_std=hf.get("initializer_range", 0.02), pad_id=token("pad_token_id", 0),
        bos_id=token("bos_token_id", 2), eos_id=token("eos_token_id", 1))
    fields["decoder_start_id"] = fields["bos_id"]
    fields.update(overrides)
    return build_config(fields, source)


# aiayn's norms in a layer -> Gemma's names: one before and one after each sub-layer
GEMMA_NORMS = {"self_attention_residual.norm": "input_layernorm",
               "self_attention_residual.post_norm": "post_attention_layernorm",
               "feedforward_residual.norm": "pre_feedforward_layernorm",
               "feedforward_residual.post_norm": "post_feedforward_layernorm"}


def name_map(config: TransformerConfig, prefix: str, *, has_head: bool) -> NameMap:
    """How a Gemma 3 checkpoint (keys under ``prefix``: "model." or "") fills a ``CausalLM``:
    Llama's map with Gemma's four norms a layer, every norm stored as w = gain - 1."""
    return llama_name_map(config, prefix, has_head=has_head, norms=GEMMA_NORMS,
                          norm_layout="plus_one")


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    if task not in (None, "causal_lm"):
        raise ValueError(f"a Gemma 3 checkpoint loads as 'causal_lm', not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    prefix = "model." if any(k.startswith("model.") for k in checkpoint.tensors) else ""
    return CausalLM(config), name_map(config, prefix,
                                      has_head="lm_head.weight" in checkpoint.tensors)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, CausalLM) and model.config.sandwich_norm


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn ``CausalLM`` as ``Gemma3ForCausalLM``."""
    config: TransformerConfig = model.config
    required = dict(norm="rms", norm_first=True, final_norm=True, positions="rotary",
                    gated_ffn=True, activation="gelu_tanh", qk_norm=True, bias=False,
                    qkv_bias=None, scale_embeddings=True, embedding_norm=False, type_vocab_size=0,
                    output_bias=False, relative_attention_buckets=0, scale_attention=True,
                    scale_output=False)
    for name, value in required.items():
        if getattr(config, name) != value:
            raise ValueError(f"cannot export as Gemma 3: it needs {name}={value!r}, the model has "
                             f"{name}={getattr(config, name)!r}")
    n = config.n_decoder_layers
    sliding = set(range(n) if config.sliding_window_layers is None
                  else config.sliding_window_layers) if config.sliding_window else set()
    local_theta = config.rope_local_theta or config.rope_theta
    if sliding and config.rope_local_theta is None and config.rope_scaling is not None:
        raise ValueError("cannot export as Gemma 3: its sliding layers' RoPE is never scaled; set "
                         "rope_local_theta")
    hf = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
              vocab_size=config.vocab_size, hidden_size=config.d_model,
              intermediate_size=config.d_ff, num_hidden_layers=n,
              num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
              head_dim=config.head_dim, query_pre_attn_scalar=config.head_dim,
              hidden_activation="gelu_pytorch_tanh", max_position_embeddings=config.max_length,
              rms_norm_eps=config.layer_norm_eps,
              sliding_window=config.sliding_window or config.max_length,
              layer_types=[SLIDING if i in sliding else FULL for i in range(n)],
              rope_parameters={FULL: {"rope_type": "default", **(config.rope_scaling or {}),
                                      "rope_theta": float(config.rope_theta)},
                               SLIDING: {"rope_type": "default", "rope_theta": float(local_theta)}},
              tie_word_embeddings=config.tie_output, attention_bias=False,
              attention_dropout=config.attention_dropout, final_logit_softcapping=None,
              attn_logit_softcapping=None, initializer_range=config.init_std or 0.02,
              bos_token_id=config.bos_id, eos_token_id=config.eos_id, pad_token_id=config.pad_id)
    return hf, name_map(config, "model.", has_head=True)
