"""DeBERTa-v2 and DeBERTa-v3 checkpoints (``DebertaV2Model``, ``DebertaV2ForMaskedLM``,
``DebertaV2ForSequenceClassification``; model_type "deberta-v2") <-> aiayn's encoder-only models
(``TransformerEncoder``, ``MaskedLM``, ``SequenceClassifier``).

DeBERTa (He et al. 2021) is BERT's post-norm encoder (``aiayn.interop.hf_bert``: an embedding
LayerNorm, GELU, the same layer names apart from ``query_proj`` / ``key_proj`` / ``value_proj``)
with disentangled attention (``aiayn.nn.disentangled``), each setting a TransformerConfig field:

- ``relative_attention`` and ``pos_att_type`` -> ``disentangled_attention`` terms; the table of
  ``rel_embeddings`` has 2k rows, k = ``position_buckets`` when > 0 (log-bucketed distances up to
  ``max_relative_positions``), else ``max_relative_positions`` (or ``max_position_embeddings`` when
  that is < 1; distances clamped); ``norm_rel_ebd`` "layer_norm" -> ``norm``
  (``encoder.LayerNorm``); ``share_att_key`` -> ``share_projections`` (else ``pos_key_proj`` /
  ``pos_query_proj``).
- the score scale (Dh * (1 + number of ``pos_att_type`` terms))^-1/2 -> ``attention_scale``.
- ``position_biased_input`` -> ``positions`` "learned" (v2) or "none" (v3);
  ``max_position_embeddings`` -> ``max_length``: the commands' token limit, and the input limit of
  a v2 model; a v3 model (relative distances only) runs longer inputs, as transformers does.
- The classification head ``pooler.dense`` + ``pooler_hidden_act`` (GELU by default) +
  ``classifier`` on the first token: aiayn's pooler and classifier.
- The masked-LM head, BERT's dense + activation + LayerNorm + the tied word embeddings + a bias, in
  either layout: ``cls.predictions.*`` (transformers 4, and 5's default ``legacy``) or
  ``lm_predictions.lm_head.*`` (transformers 5 with ``legacy: false``, and Microsoft's own files);
  whichever the checkpoint holds is read. ``mask_predictions.*`` (DeBERTa-v3's replaced-token
  detection head) is dropped, and a bare model whose file holds an MLM head drops it unless loaded
  as ``task="masked_lm"``.

Refused, naming the field: ``conv_kernel_size`` > 0 (DeBERTa-v2-xlarge's convolution beside the
first layer), ``embedding_size`` != ``hidden_size`` (``embed_proj``), ``attention_head_size`` other
than hidden_size / heads, ``pooler_hidden_size`` != ``hidden_size``, ``pos_att_type`` entries other
than c2p and p2c (or none with ``relative_attention``), ``norm_rel_ebd`` other than none and
layer_norm, activations aiayn has not; model_type "deberta" (v1) is not loaded.

``save_pretrained`` writes a model with ``disentangled_attention`` as DeBERTa-v2 (the legacy MLM
layout, which both transformers 4 and 5 read).

Legend: D model width, V vocabulary, C classes, k the relative span.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop import hf_bert
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, CONFIG_FILE, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder
from aiayn.nn.disentangled import TERMS, disentangled_spec

MODEL_TYPES = ("deberta-v2",)
ARCHITECTURES = {"DebertaV2Model": "encoder", "DebertaV2ForMaskedLM": "masked_lm",
                 "DebertaV2ForSequenceClassification": "classification"}
# BERT's layer names under DeBERTa's prefix, with the legacy MLM head (BERT's names too)
DEBERTA = dataclasses.replace(
    hf_bert.BERT, family="DeBERTa", prefix="deberta.",
    qkv=("attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj"),
    pooler="pooler.dense", pooler_in_base=False)
# transformers 5 with legacy=false, and Microsoft's files: one bias, the projection always tied
DEBERTA_LM_HEAD = dataclasses.replace(
    DEBERTA, mlm_dense="lm_predictions.lm_head.dense", mlm_norm="lm_predictions.lm_head.LayerNorm",
    mlm_bias=("lm_predictions.lm_head.bias",), mlm_projection="lm_predictions.lm_head.decoder",
    mlm_keys=r"lm_predictions\..*")


def _fail(source, message: str):
    raise ValueError(f"{source / CONFIG_FILE}: {message}")


def _terms(hf: dict[str, Any], source) -> list[str]:
    """``pos_att_type`` as a list ("p2c|c2p" strings as transformers splits them)."""
    value = hf.get("pos_att_type") or []
    if isinstance(value, str):
        value = [part.strip() for part in value.lower().split("|")]
    if not isinstance(value, list) or not set(value) <= set(TERMS):
        _fail(source, f"pos_att_type={hf.get('pos_att_type')!r} is not supported; aiayn takes "
                      f"any of {list(TERMS)}")
    return [term for term in TERMS if term in value]


def _disentangled(hf: dict[str, Any], terms: list[str], source) -> dict[str, Any] | None:
    """``disentangled_attention`` of a DeBERTa config (None without ``relative_attention``)."""
    if not hf.get("relative_attention", False):
        return None
    if not terms:
        _fail(source, "relative_attention=true with no pos_att_type is not supported (its "
                      "relative embeddings would add nothing); set pos_att_type")
    norms = [part.strip() for part in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
    if not set(norms) <= {"none", "layer_norm"}:
        _fail(source, f"norm_rel_ebd={hf['norm_rel_ebd']!r} is not supported; aiayn takes "
                      f"'none' or 'layer_norm'")
    distance = hf.get("max_relative_positions", -1)
    buckets = hf.get("position_buckets", -1)
    for name, value in (("max_relative_positions", distance), ("position_buckets", buckets)):
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(source, f"{name}={value!r} must be an integer")
    if distance < 1:
        distance = hf.get("max_position_embeddings", 512)
    spec = dict(terms=terms, share_projections=bool(hf.get("share_att_key", False)),
                norm="layer_norm" in norms)
    if buckets > 0:
        return dict(spec, span=buckets, max_distance=distance)
    return dict(spec, span=distance)


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint, task: str,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a DeBERTa-v2/v3 config.json (``overrides`` win, e.g. ``num_labels``)."""
    source = checkpoint.directory
    width = require(hf, "hidden_size", source)
    heads = require(hf, "num_attention_heads", source)
    if hf.get("conv_kernel_size", 0):
        _fail(source, f"conv_kernel_size={hf['conv_kernel_size']!r} is not supported (the "
                      f"convolution beside DeBERTa-v2-xlarge's first layer); aiayn loads 0")
    for name in ("embedding_size", "pooler_hidden_size"):
        if hf.get(name, width) != width:
            _fail(source, f"{name}={hf[name]!r} differs from hidden_size={width}; aiayn loads "
                          f"equal widths")
    if heads and hf.get("attention_head_size", width // heads) * heads != width:
        _fail(source, f"attention_head_size={hf['attention_head_size']!r} is not "
                      f"hidden_size / num_attention_heads")
    terms = _terms(hf, source)
    lm_layout = any(key.startswith("lm_predictions.") for key in checkpoint.tensors)
    fields = hf_bert.encoder_fields(hf, task, require(hf, "vocab_size", source))
    position_biased = hf.get("position_biased_input", True)
    fields.update(
        d_model=width, n_heads=heads, d_ff=require(hf, "intermediate_size", source),
        n_encoder_layers=require(hf, "num_hidden_layers", source),
        max_length=hf.get("max_position_embeddings", 512),
        positions="learned" if position_biased else "none",
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        activation=activation_from_hf(hf.get("hidden_act", "gelu"), "hidden_act", source),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-7), type_vocab_size=hf.get("type_vocab_size", 0),
        pooler_activation=activation_from_hf(hf.get("pooler_hidden_act", "gelu"),
                                             "pooler_hidden_act", source),
        # the score scale counts pos_att_type's terms even without relative_attention, as
        # transformers does
        attention_scale=1 / math.sqrt(width // heads * (1 + len(terms))) if terms else None,
        disentangled_attention=_disentangled(hf, terms, source))
    if lm_layout:  # this head always multiplies by the word embeddings
        fields["tie_output"] = True
    fields.update(overrides)
    return build_config(fields, source)


def disentangled_rules(config: TransformerConfig, ours: str, prefix: str) -> list[Rule]:
    """The relative table and, without shared projections, each layer's own projections of it."""
    spec = disentangled_spec(config)
    if spec is None:
        return []
    kinds = ("weight", "bias")
    rules = [Rule(f"{ours}relative.embedding.weight", (f"{prefix}encoder.rel_embeddings.weight",))]
    if spec.norm:
        rules += [Rule(f"{ours}relative.norm.{kind}", (f"{prefix}encoder.LayerNorm.{kind}",))
                  for kind in kinds]
    if not spec.share_projections:
        layer = f"{ours}layers.{{}}.self_attention.disentangled."
        hf_layer = f"{prefix}encoder.layer.{{}}.attention.self."
        n = config.n_encoder_layers
        for term, ours_name, hf_name in (("c2p", "key_proj", "pos_key_proj"),
                                         ("p2c", "query_proj", "pos_query_proj")):
            if term in spec.terms:
                rules += [Rule(f"{layer}{ours_name}.{kind}", (f"{hf_layer}{hf_name}.{kind}",), n)
                          for kind in kinds]
    return rules


def _name_map(config: TransformerConfig, task: str, prefix: str, *, source_task: str,
              has_pooler: bool, names: hf_bert.Names) -> NameMap:
    name_map = hf_bert.name_map(config, task, prefix, has_pooler=has_pooler,
                                source_task=source_task, names=names)
    ours = "encoder." if task == "encoder" else "encoder.encoder."
    name_map.rules += disentangled_rules(config, ours, prefix)
    name_map.dropped.append(r"mask_predictions\..*")  # DeBERTa-v3's replaced-token detection
    if config.positions == "none":  # transformers ignores such a table too
        name_map.dropped.append(rf"{re.escape(prefix)}embeddings\.position_embeddings\.weight")
    return name_map


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    declared = ARCHITECTURES[architecture]
    task = task or declared
    if task not in hf_bert.TASKS:
        raise ValueError(f"a DeBERTa checkpoint loads as one of {sorted(hf_bert.TASKS)}, not "
                         f"task={task!r}")
    tensors = checkpoint.tensors
    names = DEBERTA_LM_HEAD if any(key.startswith("lm_predictions.") for key in tensors) \
        else DEBERTA
    # Microsoft's files name no architecture but hold an MLM head: a bare model drops it
    has_mlm = f"{names.mlm_dense}.weight" in tensors
    source_task = "masked_lm" if declared == "encoder" and has_mlm else declared
    config = config_from_hf(checkpoint.config, checkpoint, task, overrides)
    prefix = DEBERTA.prefix if any(key.startswith(DEBERTA.prefix) for key in tensors) else ""
    has_pooler = f"{DEBERTA.pooler}.weight" in tensors
    return hf_bert.TASKS[task](config), _name_map(config, task, prefix, source_task=source_task,
                                                  has_pooler=has_pooler, names=names)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    """An encoder-only model with disentangled attention."""
    return (isinstance(model, (TransformerEncoder, MaskedLM, SequenceClassifier))
            and model.config.disentangled_attention is not None)


EXPORT_REQUIRED = dict(
    norm="layer", norm_first=False, final_norm=False, position_offset=0, scale_embeddings=False,
    embedding_norm=True, bias=True, head_bias=True, gated_ffn=False, d_head=None, n_kv_heads=None,
    qkv_bias=None, qk_norm=False, sandwich_norm=False, attention_softcap=None, logit_softcap=None,
    sliding_window=None, relative_attention_buckets=0, scale_attention=True, scale_output=False,
    layer_norm_bias=True, positions_skip_padding=False)


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn encoder-only model as DeBERTa-v2."""
    config: TransformerConfig = model.config
    spec = disentangled_spec(config)
    required = dict(EXPORT_REQUIRED)
    if isinstance(model, SequenceClassifier):
        required.update(pooler=True, pooler_norm=False, pooling="first")
    if isinstance(model, MaskedLM):
        required.update(mlm_transform=True, output_bias=True)
    require_fields(config, required, "DeBERTa")
    if config.positions not in ("learned", "none"):
        raise ValueError(f"cannot export as DeBERTa: it needs positions='learned' or 'none', the "
                         f"model has positions={config.positions!r}")
    scale = 1 / math.sqrt(config.head_dim * (1 + len(spec.terms)))
    if config.attention_scale is None or not math.isclose(config.attention_scale, scale):
        raise ValueError(f"cannot export as DeBERTa: it scales scores by (Dh * (1 + terms))^-1/2 "
                         f"= {scale!r}, the model has attention_scale={config.attention_scale!r}")
    kind = {TransformerEncoder: "Model", MaskedLM: "ForMaskedLM",
            SequenceClassifier: "ForSequenceClassification"}[type(model)]
    task = ARCHITECTURES[f"DebertaV2{kind}"]
    buckets = spec.max_distance is not None
    hf = {**hf_bert.hf_config(config, f"DebertaV2{kind}"), "model_type": "deberta-v2",
          "relative_attention": True, "pos_att_type": list(spec.terms),
          "position_buckets": spec.span if buckets else -1,
          "max_relative_positions": spec.max_distance if buckets else spec.span,
          "share_att_key": spec.share_projections,
          "norm_rel_ebd": "layer_norm" if spec.norm else "none",
          "position_biased_input": config.positions == "learned",
          "pooler_hidden_act": AIAYN_ACTIVATIONS[config.pooler_activation],
          "pooler_hidden_size": config.d_model, "pooler_dropout": 0.0, "legacy": True,
          "conv_kernel_size": 0}
    hf.pop("position_embedding_type")
    return hf, _name_map(config, task, "" if task == "encoder" else DEBERTA.prefix,
                         source_task=task, has_pooler=task == "classification", names=DEBERTA)
