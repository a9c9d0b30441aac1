"""Phi-3 and Phi-4 checkpoints (``Phi3ForCausalLM``, ``Phi3Model``; model_type "phi3") <-> aiayn's
``CausalLM``.

Phi-3 is the Llama decoder (aiayn/interop/hf_llama.py: rotary positions, RMSNorm, SwiGLU,
grouped-query attention, no biases) with Mistral's sliding window on every layer when
``sliding_window`` is set (Phi-3-mini-4k: 2047 keys of its 4096 positions; applied as transformers
5 applies it), stored with two fused tensors per layer:

    self_attn.qkv_proj.weight   ((H + 2 Hkv) Dh, D): rows q, then k, then v  -> aiayn's qkv_proj
                                                       (as is; split with fused_projections=False)
    mlp.gate_up_proj.weight     (2 F, D): rows gate, then up                -> gate_proj, up_proj

The config is Llama's (``hf_llama.config_from_hf``: sizes, ``rms_norm_eps``, ``hidden_act``,
``tie_word_embeddings``, ``attention_dropout``, the token ids) plus the window, ``resid_pdrop``
(dropout on each sub-layer's output: aiayn's ``dropout``, which also drops the embeddings;
transformers 5's ``Phi3Model`` reads no ``embd_pdrop``) and Phi-3's rotary positions, read as
transformers 5's ``Phi3Config`` reads them:

- the RoPE settings from ``rope_scaling`` (transformers 4's layout) when set, else
  ``rope_parameters`` (5's); ``rope_theta`` from them or the top level;
- ``partial_rotary_factor`` (from the RoPE settings, else the top level; Phi-4-mini: 0.75) ->
  ``rotary_fraction``;
- LongRoPE, type "longrope" ("su" and "yarn" in a Phi-3 config mean the same; Phi-3-mini-128k,
  Phi-3.5-mini, Phi-4-mini) -> ``rope_scaling`` "longrope" with its ``short_factor`` and
  ``long_factor``, ``original_max_position_embeddings`` from the top level (``Phi3Config``'s
  default 4096 when absent: transformers takes it over the RoPE settings' own), ``factor``
  max_position_embeddings / original unless given, and ``attention_factor`` when given.

``save_pretrained`` writes a rotary ``CausalLM`` with partial rotary positions or LongRoPE as
Phi-3 (no other class aiayn writes has them); any other as Llama (or Mistral) unless asked for
``model_type="phi3"``. Phi-3 fuses the projections back.

Legend: D model width, F feed-forward width, H heads, Hkv key/value heads, Dh head width.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop import hf_llama
from aiayn.interop.hf_common import CONFIG_FILE, Checkpoint, NameMap, Rule, require_fields
from aiayn.models import CausalLM

MODEL_TYPES = ("phi3",)
ARCHITECTURES = {"Phi3ForCausalLM": "causal_lm", "Phi3Model": "causal_lm"}
# rope types a Phi-3 config.json may name for LongRoPE (transformers reads "su" and "yarn" as it)
LONGROPE = ("longrope", "su", "yarn")
DEFAULT_ORIGINAL = 4096  # Phi3Config's original_max_position_embeddings when config.json has none


def _rope(hf: dict[str, Any], source) -> dict[str, Any]:
    """rope_theta, rope_scaling and rotary_fraction of a Phi-3 config.json (the module
    docstring); other RoPE types refused, naming the setting."""
    parameters = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind in LONGROPE:
        parameters.update(rope_type="longrope", original_max_position_embeddings=hf.get(
            "original_max_position_embeddings", DEFAULT_ORIGINAL))
        parameters.pop("type", None)
    elif kind != "default":
        raise ValueError(f"{source / CONFIG_FILE}: rope_scaling type {kind!r} is not supported "
                         f"for Phi-3 (transformers' Phi3Config takes 'default' or 'longrope')")
    fraction = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    fraction = 1.0 if fraction is None else fraction
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) \
            or not 0 < fraction <= 1:
        raise ValueError(f"{source / CONFIG_FILE}: partial_rotary_factor={fraction!r} must be a "
                         f"number in (0, 1]: the share of each head that rotary positions turn")
    theta, scaling = hf_llama.rope_settings(parameters, hf.get("rope_theta", 10000.0),
                                            hf.get("max_position_embeddings", 4096), source,
                                            longrope=True)
    return dict(rope_theta=theta, rope_scaling=scaling, rotary_fraction=float(fraction))


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a Phi-3 config.json: Llama's, with Phi-3's window, dropout and rotary
    positions and its defaults where a field is absent (``overrides`` win)."""
    source = checkpoint.directory
    rope = _rope(hf, source)
    window = hf.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        window = None
    dropout = hf.get("resid_pdrop") or 0.0
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{source / CONFIG_FILE}: resid_pdrop={dropout!r} must be in [0, 1)")
    phi3 = dict(sliding_window=window, sliding_window_layers=None, dropout=float(dropout),
                max_length=hf.get("max_position_embeddings", 4096),
                layer_norm_eps=hf.get("rms_norm_eps", 1e-5), **rope)
    llama = {key: value for key, value in hf.items()  # Phi-3's RoPE settings are read above
             if key not in ("rope_scaling", "rope_parameters", "partial_rotary_factor")}
    return hf_llama.config_from_hf(llama, checkpoint, {**phi3, **overrides})


def name_map(config: TransformerConfig, prefix: str, *, has_head: bool) -> NameMap:
    """How a Phi-3 checkpoint (keys under ``prefix``: "model." or "") fills a ``CausalLM``:
    Llama's map, with q, k, v and the FFN's gate and up taken from the two fused tensors."""
    names = hf_llama.name_map(config, prefix, has_head=has_head)
    n, layer, hf_layer = config.n_decoder_layers, "decoder.layers.{}.", f"{prefix}layers.{{}}."
    qkv, gate_up = f"{hf_layer}self_attn.qkv_proj.weight", f"{hf_layer}mlp.gate_up_proj.weight"
    inner, kv_inner = config.n_heads * config.head_dim, config.kv_heads * config.head_dim
    if config.fused_projections:  # aiayn's qkv_proj has Phi-3's rows: q | k | v
        rules = [Rule(f"{layer}self_attention.qkv_proj.weight", (qkv,), n)]
    else:
        rules = [Rule(f"{layer}self_attention.{name}_proj.weight", (qkv,), n, rows=rows)
                 for name, rows in zip("qkv", _blocks(inner, kv_inner, kv_inner))]
    rules += [Rule(f"{layer}feedforward.{name}.weight", (gate_up,), n, rows=rows)
              for name, rows in zip(("gate_proj", "up_proj"), _blocks(config.d_ff, config.d_ff))]
    fused = {rule.target for rule in rules}
    names.rules = [rule for rule in names.rules if rule.target not in fused] + rules
    return names


def _blocks(*sizes: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, stop) of the given sizes, from row 0."""
    return [(stop - size, stop) for size, stop in zip(sizes, accumulate(sizes))]


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    if task not in (None, "causal_lm"):
        raise ValueError(f"a Phi-3 checkpoint loads as 'causal_lm', not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    prefix = "model." if any(k.startswith("model.") for k in checkpoint.tensors) else ""
    return CausalLM(config), name_map(config, prefix,
                                      has_head="lm_head.weight" in checkpoint.tensors)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    """Any rotary ``CausalLM``; hf_llama, earlier in ``hf.FAMILIES``, takes those it can write,
    so this family writes, unasked, only partial rotary positions and LongRoPE."""
    return hf_llama.is_rotary_lm(model)


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn rotary ``CausalLM`` as
    ``Phi3ForCausalLM``: Llama's config.json (and its checks) with Phi-3's fields."""
    config: TransformerConfig = model.config
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] != "longrope":
        raise ValueError(f"cannot export as Phi-3: its scaled RoPE is LongRoPE; the model has "
                         f"rope_scaling of rope_type={scaling['rope_type']!r}")
    required = dict(hf_llama.EXPORT_REQUIRED, bias=False, qk_norm=False,
                    sliding_window_layers=None, sandwich_norm=False,
                    attention_softcap=None, logit_softcap=None)
    required.pop("rotary_fraction")
    require_fields(config, required, "Phi-3", subject="it")
    if config.qkv_bias:
        raise ValueError("cannot export as Phi-3: it has no biases; the model has qkv_bias=True")
    hf = hf_llama.config_to_hf(config.replace(rotary_fraction=1.0, rope_scaling=None))
    for name in ("attention_bias", "mlp_bias"):  # Llama's; Phi-3 has no biases
        hf.pop(name, None)
    hf.update(model_type="phi3", architectures=["Phi3ForCausalLM"],
              sliding_window=config.sliding_window, resid_pdrop=config.dropout,
              embd_pdrop=config.dropout, **_rope_to_hf(config))
    return hf, name_map(config, "model.", has_head=True)


def _rope_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """Phi-3's RoPE fields: transformers 5's ``rope_parameters`` and, for LongRoPE, 4's
    ``rope_scaling`` (type, short_factor, long_factor; ``factor`` and ``attention_factor`` only
    where they differ from what transformers derives), which both read first."""
    theta, fraction, scaling = float(config.rope_theta), config.rotary_fraction, config.rope_scaling
    rope = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": fraction}
    if scaling is None:
        return dict(rope_parameters=rope, rope_scaling=None, partial_rotary_factor=fraction,
                    original_max_position_embeddings=config.max_length)
    original = scaling["original_max_position_embeddings"]
    legacy = {"type": "longrope", "short_factor": scaling["short_factor"],
              "long_factor": scaling["long_factor"]}
    if scaling["factor"] != config.max_length / original:
        legacy["factor"] = scaling["factor"]
    if scaling.get("attention_factor") is not None:
        legacy["attention_factor"] = scaling["attention_factor"]
    return dict(rope_parameters={**rope, **scaling}, rope_scaling=legacy,
                partial_rotary_factor=fraction, original_max_position_embeddings=original)
