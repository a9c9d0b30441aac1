"""Llama checkpoints (``LlamaForCausalLM``, ``LlamaModel``) <-> aiayn's ``CausalLM``, and the three
families that are Llama with one change each: Mistral (a sliding attention window), Qwen2 (biases on
the q, k, v projections: ``qkv_bias``) and Qwen3 (RMSNorm on every head's q and k: ``qk_norm``).

Llama is the GPT decoder with four changes, each a TransformerConfig field (docs/modern-decoder.md):
rotary positions on q and k (``positions="rotary"``, ``rope_theta``), RMSNorm (``norm="rms"``), the
SwiGLU feed-forward (``gated_ffn``, ``activation="silu"``) and grouped-query attention
(``n_kv_heads``). Besides: pre-norm with a final norm, no biases (``attention_bias`` / ``mlp_bias``),
no embedding scale, no dropout on the residual stream, and an output projection of its own unless
``tie_word_embeddings``. Scaled RoPE (``rope_type`` "linear", "llama3" of Llama 3.1 and later,
"yarn") becomes ``rope_scaling``; "dynamic" is refused (aiayn.nn.rotary), and "longrope" is read
for Phi-3 (hf_phi3).

A sliding window (Mistral 7B v0.1's 4096 on every layer; Qwen's on the layers ``layer_types`` names)
becomes ``sliding_window`` and ``sliding_window_layers``.

HF keeps q_proj, k_proj and v_proj apart; they are concatenated into aiayn's fused ``qkv_proj``
((H + 2 Hkv) Dh rows), or kept apart with ``fused_projections=False``.

Legend: D model width, F feed-forward width, V vocabulary, H heads, Hkv key/value heads, Dh head width.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, CONFIG_FILE, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models import CausalLM
from aiayn.nn.rotary import check_rope_scaling, longrope_switch

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {f"{name}{suffix}": "causal_lm" for name in ("Llama", "Mistral", "Qwen2", "Qwen3")
                 for suffix in ("ForCausalLM", "Model")}


def _rope(hf: dict[str, Any], source) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaled RoPE (``rope_scaling``, None when plain) of a config.json:
    transformers 5 keeps both in ``rope_parameters``, 4 in ``rope_theta`` and ``rope_scaling``.
    A ``partial_rotary_factor`` below 1 is refused: aiayn reads partial rotary positions for
    Phi-3 alone (hf_phi3)."""
    parameters = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    fraction = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction is not None and fraction != 1:
        raise ValueError(f"{source / CONFIG_FILE}: partial_rotary_factor={fraction!r} is not "
                         f"supported for model_type {hf.get('model_type')!r}: aiayn reads "
                         f"partial rotary positions for Phi-3 (model_type 'phi3') alone")
    return rope_settings(parameters, hf.get("rope_theta", 10000.0),
                         hf.get("max_position_embeddings"), source)


def rope_settings(parameters: dict[str, Any], theta: float, max_length: int | None,
                  source, *, longrope: bool = False) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of one set of HF RoPE parameters (``theta`` when they hold
    none), with the fields transformers fills in for "llama3", "yarn" and "longrope"; refused
    scalings named with their config.json. ``longrope``: the family runs LongRoPE (Phi-3);
    a ``partial_rotary_factor`` among the parameters is the caller's to read (hf_phi3)."""
    parameters = dict(parameters)
    parameters.pop("partial_rotary_factor", None)
    theta = float(parameters.pop("rope_theta", theta))
    kind = parameters.pop("rope_type", parameters.pop("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "longrope" and not longrope:
        raise ValueError(f"{source / CONFIG_FILE}: rope_type='longrope' is not supported for "
                         f"this family: aiayn reads LongRoPE for Phi-3 (model_type 'phi3')")
    if kind in ("llama3", "yarn", "longrope"):  # as transformers fills them in
        parameters.setdefault("original_max_position_embeddings", max_length)
    if kind in ("yarn", "longrope") and parameters.get("factor") is None and max_length:
        parameters["factor"] = max_length / parameters["original_max_position_embeddings"]
    scaling = {"rope_type": kind, **parameters}
    try:
        check_rope_scaling(scaling)
    except ValueError as error:
        raise ValueError(f"{source / CONFIG_FILE}: {error}") from None
    return theta, scaling


def token_id(value: Any, vocab_size: int) -> int | None:
    """A config.json token id (the first of a list); None when absent or outside the vocabulary."""
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, int) and 0 <= value < vocab_size else None


def _biases(hf: dict[str, Any], source) -> tuple[bool, bool]:
    """(bias, qkv_bias) of each family: Llama's attention_bias and mlp_bias, Qwen2's fixed biases on
    q, k, v only, Qwen3's and Mistral's none."""
    model_type = hf.get("model_type")
    if model_type == "qwen2":
        return False, True
    attention_bias = hf.get("attention_bias", False)
    mlp_bias = hf.get("mlp_bias", False) if model_type == "llama" else False
    if attention_bias != mlp_bias:
        raise ValueError(f"{source / CONFIG_FILE}: attention_bias={attention_bias} with "
                         f"mlp_bias={mlp_bias} is not supported (aiayn's bias covers both)")
    return bool(attention_bias), bool(attention_bias)


def _window(hf: dict[str, Any], layers: int) -> tuple[int | None, list[int] | None]:
    """(sliding_window, sliding_window_layers): Mistral's window on every layer; Qwen's on the
    layers ``layer_types`` names "sliding_attention" (transformers 5), else, with
    ``use_sliding_window``, on layers from ``max_window_layers`` on (how transformers 5 fills it)."""
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 \
            or hf.get("model_type") == "llama":
        return None, None
    if hf.get("model_type") == "mistral":
        return window, None
    kinds = hf.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    elif hf.get("use_sliding_window"):
        sliding = list(range(hf.get("max_window_layers", 0), layers))
    else:
        sliding = []
    if not sliding:
        return None, None
    return window, None if len(sliding) == layers else sliding


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a Llama, Mistral, Qwen2 or Qwen3 config.json (``overrides`` win)."""
    source = checkpoint.directory
    bias, qkv_bias = _biases(hf, source)
    window, sliding_layers = _window(hf, require(hf, "num_hidden_layers", source))
    vocab_size = require(hf, "vocab_size", source)
    rope_theta, rope_scaling = _rope(hf, source)
    d_model = require(hf, "hidden_size", source)
    heads = require(hf, "num_attention_heads", source)
    head_dim = hf.get("head_dim") or d_model // heads
    eos = token_id(hf.get("eos_token_id"), vocab_size)
    bos = token_id(hf.get("bos_token_id"), vocab_size)
    pad = token_id(hf.get("pad_token_id"), vocab_size)
    eos = eos if eos is not None else (bos if bos is not None else 0)
    bos = bos if bos is not None else eos
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=d_model, n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_head=None if head_dim * heads == d_model else head_dim,
        d_ff=require(hf, "intermediate_size", source), n_encoder_layers=0,
        n_decoder_layers=require(hf, "num_hidden_layers", source),
        max_length=hf.get("max_position_embeddings", 2048), dropout=0.0,
        attention_dropout=hf.get("attention_dropout", 0.0),
        activation=activation_from_hf(hf.get("hidden_act", "silu"), "hidden_act", source),
        gated_ffn=True, norm="rms", norm_first=True, final_norm=True,
        layer_norm_eps=hf.get("rms_norm_eps", 1e-6), positions="rotary",
        rope_theta=rope_theta, rope_scaling=rope_scaling, scale_embeddings=False,
        embedding_norm=False, type_vocab_size=0, bias=bias,
        qkv_bias=None if qkv_bias == bias else qkv_bias, qk_norm=hf.get("model_type") == "qwen3",
        sliding_window=window, sliding_window_layers=sliding_layers,
        tie_output=hf.get("tie_word_embeddings", False), output_bias=False,
        init_std=hf.get("initializer_range", 0.02), pad_id=pad if pad is not None else eos,
        embedding_padding_idx=pad is not None,  # transformers' padding_idx: the config's pad
        bos_id=bos, eos_id=eos, decoder_start_id=bos)
    fields.update(overrides)
    return build_config(fields, source)


# aiayn's norms in a layer -> Llama's names for them
LLAMA_NORMS = {"self_attention_residual.norm": "input_layernorm",
               "feedforward_residual.norm": "post_attention_layernorm"}


def name_map(config: TransformerConfig, prefix: str, *, has_head: bool,
             norms: dict[str, str] = LLAMA_NORMS, norm_layout: str = "same") -> NameMap:
    """How a Llama-family checkpoint (keys under ``prefix``: "model." or "") fills a ``CausalLM``.

    ``norms``: the layer's residual norms by their HF names; ``norm_layout``: how every norm
    weight is stored (Gemma: "plus_one")."""
    n = config.n_decoder_layers
    layer, hf_layer = "decoder.layers.{}.", f"{prefix}layers.{{}}."
    rules = [Rule("decoder.embeddings.tokens.weight", (f"{prefix}embed_tokens.weight",)),
             Rule("decoder.norm.weight", (f"{prefix}norm.weight",), layout=norm_layout)]
    rules += [Rule(f"{layer}{ours}.weight", (f"{hf_layer}{theirs}.weight",), n, layout=norm_layout)
              for ours, theirs in norms.items()]
    inner, kv_inner = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
    for kind in ("weight", "bias") if qkv_bias else ("weight",):
        q, k, v = (f"{hf_layer}self_attn.{name}.{kind}" for name in ("q_proj", "k_proj", "v_proj"))
        if config.fused_projections:
            rules.append(Rule(f"{layer}self_attention.qkv_proj.{kind}", (q, k, v), n,
                              sizes=(inner, kv_inner, kv_inner)))
        else:
            rules += [Rule(f"{layer}self_attention.{name}_proj.{kind}", (hf,), n)
                      for name, hf in (("q", q), ("k", k), ("v", v))]
    if config.qk_norm:  # Qwen3, Gemma 3
        rules += [Rule(f"{layer}self_attention.{name}.weight",
                       (f"{hf_layer}self_attn.{name}.weight",), n, layout=norm_layout)
                  for name in ("q_norm", "k_norm")]
    for kind in ("weight", "bias") if config.bias else ("weight",):
        rules.append(Rule(f"{layer}self_attention.out_proj.{kind}",
                          (f"{hf_layer}self_attn.o_proj.{kind}",), n))
        rules += [Rule(f"{layer}feedforward.{name}.{kind}", (f"{hf_layer}mlp.{name}.{kind}",), n)
                  for name in ("gate_proj", "up_proj", "down_proj")]
    ties, new = [], []
    if config.tie_output:
        ties.append((f"{prefix}embed_tokens.weight", "lm_head.weight"))
    elif has_head:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    else:
        new.append("lm_head.weight")
    # Older checkpoints store the rotary frequencies as a buffer: not a weight (aiayn recomputes it).
    ignore = [rf"{prefix}(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"]
    return NameMap(rules, ties=ties, ignore=ignore, new=new)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    if task not in (None, "causal_lm"):
        raise ValueError(f"a Llama checkpoint loads as 'causal_lm', not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    prefix = "model." if any(k.startswith("model.") for k in checkpoint.tensors) else ""
    return CausalLM(config), name_map(config, prefix,
                                      has_head="lm_head.weight" in checkpoint.tensors)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    """A rotary ``CausalLM`` that turns whole heads without LongRoPE (those Phi-3 writes)."""
    return is_rotary_lm(model) and not needs_phi3(model.config)


def is_rotary_lm(model: nn.Module) -> bool:
    return isinstance(model, CausalLM) and model.config.positions == "rotary"


def needs_phi3(config: TransformerConfig) -> bool:
    """Partial rotary positions or LongRoPE: of the classes aiayn writes, Phi-3 alone has them."""
    return config.rotary_fraction != 1 or longrope_switch(config.rope_scaling) is not None


def _export_family(config: TransformerConfig) -> str:
    """Which class writes the model: Qwen3 for QK-norm, Qwen2 for biases on q, k, v alone, else
    Llama (biases everywhere or nowhere), or Mistral for Llama with a window on every layer."""
    family = _bias_family(config)
    if config.sliding_window is None:
        return family
    if family == "llama":
        if config.sliding_window_layers is not None or config.bias:
            raise ValueError("cannot export as Mistral: Mistral slides on every layer and has no "
                             "biases; a window on some layers only is Qwen's (qkv_bias or qk_norm)")
        return "mistral"
    return family


def _bias_family(config: TransformerConfig) -> str:
    qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
    if config.qk_norm:
        if config.bias or qkv_bias:
            raise ValueError(f"cannot export as Qwen3 (QK-norm): Qwen3's biases cover the attention "
                             f"and not the FFN; the model has bias={config.bias}, "
                             f"qkv_bias={config.qkv_bias}")
        return "qwen3"
    if qkv_bias and not config.bias:
        return "qwen2"
    if qkv_bias != config.bias:
        raise ValueError(f"cannot export as Llama: Llama has biases on every projection or on "
                         f"none; the model has bias={config.bias}, qkv_bias={config.qkv_bias}")
    return "llama"


# What every class ``export`` writes needs of an aiayn config
EXPORT_REQUIRED = dict(norm_first=True, final_norm=True, norm="rms", positions="rotary",
                       gated_ffn=True, scale_embeddings=False, embedding_norm=False,
                       type_vocab_size=0, output_bias=False, relative_attention_buckets=0,
                       scale_attention=True, attention_scale=None, scale_output=False,
                       rope_local_theta=None, rotary_fraction=1.0, first_attention_norm=True,
                       attention_softcap=None, logit_softcap=None)
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn rotary ``CausalLM`` as
    ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (``_export_family``)."""
    return config_to_hf(model.config), name_map(model.config, "model.", has_head=True)


def config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """The config.json of ``export``."""
    require_fields(config, EXPORT_REQUIRED, "Llama")
    if needs_phi3(config):
        raise ValueError("cannot export as Llama: LongRoPE (rope_scaling 'longrope') is written "
                         "as Phi-3 (model_type='phi3')")
    family = _export_family(config)
    activation = "silu" if config.activation == "silu" else AIAYN_ACTIVATIONS[config.activation]
    hf = dict(model_type=family, architectures=[CLASSES[family]], vocab_size=config.vocab_size,
              hidden_size=config.d_model, intermediate_size=config.d_ff,
              num_hidden_layers=config.n_decoder_layers, num_attention_heads=config.n_heads,
              num_key_value_heads=config.kv_heads, head_dim=config.head_dim,
              hidden_act=activation, max_position_embeddings=config.max_length,
              rms_norm_eps=config.layer_norm_eps,
              rope_parameters={"rope_type": "default", **(config.rope_scaling or {}),
                               "rope_theta": float(config.rope_theta)},
              rope_theta=float(config.rope_theta), rope_scaling=config.rope_scaling,
              tie_word_embeddings=config.tie_output,
              attention_dropout=config.attention_dropout,
              initializer_range=config.init_std or 0.02, bos_token_id=config.bos_id,
              eos_token_id=config.eos_id, pad_token_id=config.pad_id)
    window, n = config.sliding_window, config.n_decoder_layers
    if family == "llama":
        hf.update(attention_bias=config.bias, mlp_bias=config.bias)
    elif family == "mistral":
        hf.update(sliding_window=window)
    else:
        sliding = range(n) if config.sliding_window_layers is None else config.sliding_window_layers
        hf.update(use_sliding_window=window is not None, sliding_window=window,
                  max_window_layers=n if window is None else min(sliding),
                  layer_types=["sliding_attention" if window is not None and i in sliding
                               else "full_attention" for i in range(n)])
        if family == "qwen3":
            hf["attention_bias"] = False
    return hf
