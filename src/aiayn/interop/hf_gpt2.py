"""GPT-2 checkpoints (``GPT2Model``, ``GPT2LMHeadModel``) <-> aiayn's ``CausalLM``.

GPT-2 is the paper's decoder without cross-attention, with: pre-norm residuals and a final LayerNorm
(``norm_first``, ``final_norm``), learned positions, no sqrt(d_model) embedding scale, the tanh GELU
("gelu_new" -> ``gelu_tanh``), and the output projection tied to the token embedding.

GPT-2 stores its projections as ``Conv1D`` with weights (in, out), the transpose of ``nn.Linear``; its
fused ``c_attn`` (D, 3D) holds q | k | v side by side, exactly aiayn's fused ``qkv_proj`` once transposed.

Legend: D model width, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models import CausalLM

MODEL_TYPES = ("gpt2",)
ARCHITECTURES = {"GPT2Model": "causal_lm", "GPT2LMHeadModel": "causal_lm"}


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a GPT-2 config.json (``overrides`` win)."""
    source = checkpoint.directory
    for name, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("add_cross_attention", False)):
        if hf.get(name, supported) != supported:
            raise ValueError(f"{source / 'config.json'}: {name}={hf[name]!r} is not supported "
                             f"(aiayn needs {supported})")
    vocab_size = require(hf, "vocab_size", source)
    d_model = require(hf, "n_embd", source)
    eos = hf.get("eos_token_id")
    eos = eos if isinstance(eos, int) and 0 <= eos < vocab_size else vocab_size - 1
    bos = hf.get("bos_token_id")
    bos = bos if isinstance(bos, int) and 0 <= bos < vocab_size else eos
    pad = hf.get("pad_token_id")
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab_size else eos  # GPT-2 has no pad token
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=d_model, n_heads=require(hf, "n_head", source),
        d_ff=hf.get("n_inner") or 4 * d_model, n_encoder_layers=0,
        n_decoder_layers=require(hf, "n_layer", source), max_length=hf.get("n_positions", 1024),
        dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
        activation=activation_from_hf(hf.get("activation_function", "gelu_new"),
                                      "activation_function", source),
        norm_first=True, final_norm=True, layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        positions="learned", position_offset=0, scale_embeddings=False, embedding_norm=False,
        type_vocab_size=0, tie_output=hf.get("tie_word_embeddings", True), output_bias=False,
        init_std=hf.get("initializer_range", 0.02), pad_id=pad, bos_id=bos, eos_id=eos,
        decoder_start_id=bos)
    fields.update(overrides)
    config = build_config(fields, source)
    if not config.fused_projections:
        raise ValueError("GPT-2 loads into fused projections only (its c_attn is one matrix); "
                         "drop fused_projections=False")
    return config


def name_map(config: TransformerConfig, prefix: str, *, has_head: bool) -> NameMap:
    """How a GPT-2 checkpoint (keys under ``prefix``: "transformer." or "") fills a ``CausalLM``."""
    n = config.n_decoder_layers
    layer, hf_layer = "decoder.layers.{}.", f"{prefix}h.{{}}."
    rules = [Rule("decoder.embeddings.tokens.weight", (f"{prefix}wte.weight",)),
             Rule("decoder.embeddings.positions.weight", (f"{prefix}wpe.weight",))]
    for kind in ("weight", "bias"):
        layout = "transpose" if kind == "weight" else "same"  # Conv1D weights are (in, out)
        for ours, hf in (("self_attention.qkv_proj", "attn.c_attn"),
                         ("self_attention.out_proj", "attn.c_proj"),
                         ("feedforward.linear1", "mlp.c_fc"), ("feedforward.linear2", "mlp.c_proj")):
            rules.append(Rule(f"{layer}{ours}.{kind}", (f"{hf_layer}{hf}.{kind}",), n, layout))
        for ours, hf in (("self_attention_residual.norm", "ln_1"),
                         ("feedforward_residual.norm", "ln_2")):
            rules.append(Rule(f"{layer}{ours}.{kind}", (f"{hf_layer}{hf}.{kind}",), n))
        rules.append(Rule(f"decoder.norm.{kind}", (f"{prefix}ln_f.{kind}",)))
    ties, new = [], []
    if config.tie_output:
        ties.append((f"{prefix}wte.weight", "lm_head.weight"))
    elif has_head:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    else:
        new.append("lm_head.weight")
    # Old checkpoints store the causal mask as buffers attn.bias / attn.masked_bias: not weights.
    return NameMap(rules, ties=ties, ignore=[rf"{prefix}h\.\d+\.attn\.(masked_)?bias"], new=new)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    if task not in (None, "causal_lm"):
        raise ValueError(f"a GPT-2 checkpoint loads as 'causal_lm', not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    prefix = "transformer." if any(k.startswith("transformer.") for k in checkpoint.tensors) else ""
    return CausalLM(config), name_map(config, prefix,
                                      has_head="lm_head.weight" in checkpoint.tensors)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, CausalLM)


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn ``CausalLM`` as ``GPT2LMHeadModel``."""
    config: TransformerConfig = model.config
    required = dict(norm_first=True, final_norm=True, positions="learned", position_offset=0,
                    scale_embeddings=False, embedding_norm=False, type_vocab_size=0, bias=True,
                    output_bias=False, fused_projections=True)
    require_fields(config, required, "GPT-2")
    hf = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
              n_embd=config.d_model, n_head=config.n_heads, n_inner=config.d_ff,
              n_layer=config.n_decoder_layers, n_positions=config.max_length,
              activation_function=AIAYN_ACTIVATIONS[config.activation],
              layer_norm_epsilon=config.layer_norm_eps, resid_pdrop=config.dropout,
              embd_pdrop=config.dropout, attn_pdrop=config.attention_dropout,
              scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
              reorder_and_upcast_attn=False, tie_word_embeddings=config.tie_output,
              bos_token_id=config.bos_id, eos_token_id=config.eos_id,
              initializer_range=config.init_std or 0.02)
    return hf, name_map(config, "transformer.", has_head=True)
