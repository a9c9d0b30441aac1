"""BERT checkpoints (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``) <-> aiayn's
encoder-only models (``TransformerEncoder``, ``MaskedLM``, ``SequenceClassifier``).

BERT is the paper's encoder (post-norm, 3.1) with: learned positions, segment (token-type) embeddings,
a LayerNorm after the embedding sum, no sqrt(d_model) scaling, erf GELU, LayerNorm eps 1e-12, a
dense + tanh pooler on [CLS] for classification, and an MLM head of dense + GELU + LayerNorm + a
projection tied to the word embeddings with its own bias. Each is a TransformerConfig field.

BERT's separate query/key/value matrices are concatenated into aiayn's fused ``qkv_proj`` (one (3D, D)
matmul), or kept separate with ``fused_projections=False``.

The name map is written against ``Names`` (where a BERT-like checkpoint keeps each weight), so the
families with BERT's blocks under other names (DistilBERT, ``hf_distilbert``; RoBERTa and XLM-R,
``hf_roberta``) reuse it.

Legend: D model width, F feed-forward width, V vocabulary, C classes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder

MODEL_TYPES = ("bert",)
ARCHITECTURES = {"BertModel": "encoder", "BertForMaskedLM": "masked_lm",
                 "BertForSequenceClassification": "classification"}
TASKS = {"encoder": TransformerEncoder, "masked_lm": MaskedLM, "classification": SequenceClassifier}


@dataclass(frozen=True)
class Names:
    """Where a BERT-like checkpoint keeps each weight (``{}``: the layer index).

    The embedding and layer names sit under the base model's ``prefix`` (``bert.``; none in a file of
    the bare base model); the head names are top-level.

    Attributes:
        family: the family's name in messages.
        prefix: the base model's prefix in the files of the head models.
        embeddings: aiayn's ``tokens`` / ``positions`` / ``token_types`` / ``norm`` -> HF names.
        layer: one layer's prefix.
        qkv: the query, key and value projections (in a layer), in that order.
        sublayers: aiayn's layer module -> HF module (in a layer), for the other weights.
        pooler: the dense layer before the classifier (its activation is the config's
            ``pooler_activation``); under ``prefix`` when ``pooler_in_base`` (BERT's belongs to
            ``BertModel``), else top-level (DistilBERT's ``pre_classifier`` belongs to the head).
        classifier: the classifier's linear layer.
        mlm_dense, mlm_norm: the MLM head's dense layer and LayerNorm.
        mlm_bias: the logits bias; several names are one tied tensor (BERT's two aliases).
        mlm_projection: the output matrix (tied to the word embeddings unless the config unties it).
        mlm_keys: regular expression of every MLM-head key (dropped when the model has no MLM head).
    """

    family: str
    prefix: str
    embeddings: dict[str, str]
    layer: str
    qkv: tuple[str, str, str]
    sublayers: dict[str, str]
    pooler: str
    pooler_in_base: bool
    classifier: str
    mlm_dense: str
    mlm_norm: str
    mlm_bias: tuple[str, ...]
    mlm_projection: str
    mlm_keys: str

    def pooler_key(self, prefix: str) -> str:
        return f"{prefix}{self.pooler}" if self.pooler_in_base else self.pooler


BERT = Names(
    family="BERT", prefix="bert.",
    embeddings={"tokens": "embeddings.word_embeddings",
                "positions": "embeddings.position_embeddings",
                "token_types": "embeddings.token_type_embeddings", "norm": "embeddings.LayerNorm"},
    layer="encoder.layer.{}.",
    qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
    sublayers={"self_attention.out_proj": "attention.output.dense",
               "attention_residual.norm": "attention.output.LayerNorm",
               "feedforward.linear1": "intermediate.dense",
               "feedforward.linear2": "output.dense",
               "feedforward_residual.norm": "output.LayerNorm"},
    pooler="pooler.dense", pooler_in_base=True, classifier="classifier",
    mlm_dense="cls.predictions.transform.dense", mlm_norm="cls.predictions.transform.LayerNorm",
    mlm_bias=("cls.predictions.bias", "cls.predictions.decoder.bias"),
    mlm_projection="cls.predictions.decoder.weight", mlm_keys=r"cls\..*")


def encoder_fields(hf: dict[str, Any], task: str, vocab_size: int) -> dict[str, Any]:
    """The TransformerConfig fields every BERT-like config shares: the paper's post-norm encoder
    with learned positions, an embedding LayerNorm and no sqrt(D) scaling; [CLS] pooling with a
    pooler for classification; BERT's MLM head (dense + activation + LayerNorm, a biased, tied
    projection); the labels and the special tokens."""
    labels = hf.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else hf.get("num_labels", 2)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, n_decoder_layers=0, norm_first=False, final_norm=False,
        positions="learned", position_offset=0, scale_embeddings=False, embedding_norm=True,
        tie_output=hf.get("tie_word_embeddings", True), output_bias=task == "masked_lm",
        init_std=hf.get("initializer_range", 0.02), num_labels=num_labels, pooling="first",
        pooler=task == "classification", mlm_transform=True,
        pad_id=hf.get("pad_token_id") if isinstance(hf.get("pad_token_id"), int) else 0)
    for hf_name, name in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
        value = hf.get(hf_name)
        if isinstance(value, int) and 0 <= value < vocab_size:
            fields[name] = value
    return fields


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint, task: str,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a BERT config.json (``overrides`` win, e.g. ``num_labels``)."""
    source = checkpoint.directory
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source / 'config.json'}: position_embedding_type="
                         f"{hf['position_embedding_type']!r} is not supported (only 'absolute')")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ValueError(f"{source / 'config.json'}: BERT as a decoder (is_decoder / "
                         f"add_cross_attention) is not supported")
    fields = encoder_fields(hf, task, require(hf, "vocab_size", source))
    fields.update(
        d_model=require(hf, "hidden_size", source),
        n_heads=require(hf, "num_attention_heads", source),
        d_ff=require(hf, "intermediate_size", source),
        n_encoder_layers=require(hf, "num_hidden_layers", source),
        max_length=hf.get("max_position_embeddings", 512),
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        activation=activation_from_hf(hf.get("hidden_act", "gelu"), "hidden_act", source),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12), type_vocab_size=hf.get("type_vocab_size", 2))
    fields.update(overrides)
    return build_config(fields, source)


def encoder_rules(config: TransformerConfig, ours: str, hf: str, names: Names = BERT) -> list[Rule]:
    """Rules for the embeddings and the layer stack; ``ours``/``hf`` are the two name prefixes."""
    n = config.n_encoder_layers
    layer, hf_layer = f"{ours}layers.{{}}.", f"{hf}{names.layer}"
    embeddings = ["tokens"] + (["positions"] if config.positions == "learned" else []) + \
        (["token_types"] if config.type_vocab_size else [])
    rules = [Rule(f"{ours}embeddings.{name}.weight", (f"{hf}{names.embeddings[name]}.weight",))
             for name in embeddings]
    for kind in ("weight", "bias"):
        rules.append(Rule(f"{ours}embeddings.norm.{kind}",
                          (f"{hf}{names.embeddings['norm']}.{kind}",)))
        if config.fused_projections:
            rules.append(Rule(f"{layer}self_attention.qkv_proj.{kind}",
                              tuple(f"{hf_layer}{name}.{kind}" for name in names.qkv), n))
        else:
            for ours_name, hf_name in zip(("q_proj", "k_proj", "v_proj"), names.qkv):
                rules.append(Rule(f"{layer}self_attention.{ours_name}.{kind}",
                                  (f"{hf_layer}{hf_name}.{kind}",), n))
        for ours_name, hf_name in names.sublayers.items():
            rules.append(Rule(f"{layer}{ours_name}.{kind}", (f"{hf_layer}{hf_name}.{kind}",), n))
    return rules


def name_map(config: TransformerConfig, task: str, prefix: str, *, has_pooler: bool,
             source_task: str, names: Names = BERT) -> NameMap:
    """How a BERT-like checkpoint (of ``source_task``, keys under ``prefix``) fills the aiayn
    ``task`` model."""
    ours = "encoder." if task == "encoder" else "encoder.encoder."
    rules = encoder_rules(config, ours, prefix, names)
    pooler = names.pooler_key(prefix)
    ties: list[tuple[str, ...]] = []
    new: list[str] = []
    dropped: list[str] = []
    if task == "classification":
        for kind in ("weight", "bias"):
            if has_pooler:
                rules.append(Rule(f"head.pooler.{kind}", (f"{pooler}.{kind}",)))
            else:
                new.append(f"head.pooler.{kind}")
            if source_task == "classification":
                rules.append(Rule(f"head.classifier.{kind}", (f"{names.classifier}.{kind}",)))
            else:
                new.append(f"head.classifier.{kind}")
    elif has_pooler:  # the encoder and the MLM head have no pooler: the checkpoint's is unused
        dropped.append(rf"{re.escape(pooler)}\.(weight|bias)")
    if task == "masked_lm":
        if len(names.mlm_bias) > 1:
            ties.append(names.mlm_bias)
        if config.tie_output:
            ties.append((f"{prefix}{names.embeddings['tokens']}.weight", names.mlm_projection))
        head = {"head.dense": names.mlm_dense, "head.norm": names.mlm_norm}
        if source_task == "masked_lm":
            rules += [Rule(f"{ours_name}.{kind}", (f"{hf_name}.{kind}",))
                      for ours_name, hf_name in head.items() for kind in ("weight", "bias")]
            rules.append(Rule("head.projection.bias", (names.mlm_bias[0],)))
            if not config.tie_output:
                rules.append(Rule("head.projection.weight", (names.mlm_projection,)))
        else:
            new += [f"{name}.{kind}" for name in head for kind in ("weight", "bias")]
            new.append("head.projection.bias")
            if not config.tie_output:
                new.append("head.projection.weight")
    elif source_task == "masked_lm":
        dropped.append(names.mlm_keys)
    if source_task == "classification" and task != "classification":
        dropped.append(rf"{re.escape(names.classifier)}\.(weight|bias)")
    return NameMap(rules, ties=ties, ignore=[rf"{re.escape(prefix)}embeddings\.position_ids"],
                   new=new, dropped=dropped)


def plan_encoder(checkpoint: Checkpoint, source_task: str, task: str | None,
                 overrides: dict[str, Any], names: Names,
                 to_config: Callable[..., TransformerConfig]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own ``source_task``) and
    its name map, for a BERT-like family: ``to_config`` is its ``config_from_hf``."""
    task = task or source_task
    if task not in TASKS:
        raise ValueError(f"a {names.family} checkpoint loads as one of {sorted(TASKS)}, "
                         f"not task={task!r}")
    config = to_config(checkpoint.config, checkpoint, task, overrides)
    # The base model's own files are bare ("embeddings.…"); the head models nest it under a prefix.
    prefix = names.prefix if any(key.startswith(names.prefix) for key in checkpoint.tensors) else ""
    has_pooler = f"{names.pooler_key(prefix)}.weight" in checkpoint.tensors
    return TASKS[task](config), name_map(config, task, prefix, has_pooler=has_pooler,
                                         source_task=source_task, names=names)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    return plan_encoder(checkpoint, ARCHITECTURES[architecture], task, overrides, BERT,
                        config_from_hf)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, (TransformerEncoder, MaskedLM, SequenceClassifier))


def check_exportable(config: TransformerConfig, model: nn.Module, *,
                     position_offset: int = 0, family: str = "BERT") -> None:
    """Raise unless the model has BERT's layout (RoBERTa's: its table offset by
    ``position_offset``)."""
    required = dict(norm_first=False, final_norm=False, positions="learned",
                    position_offset=position_offset, positions_skip_padding=position_offset > 0,
                    scale_embeddings=False, embedding_norm=True, bias=True, head_bias=True)
    if isinstance(model, SequenceClassifier):
        required.update(pooler=True, pooler_activation="tanh", pooler_norm=False, pooling="first")
    if isinstance(model, MaskedLM):
        required.update(mlm_transform=True, output_bias=True)
    require_fields(config, required, family)
    if not config.type_vocab_size:
        raise ValueError(f"cannot export as {family}: {family} needs token-type embeddings "
                         f"(type_vocab_size > 0), the model has type_vocab_size=0")


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn encoder-only model as BERT."""
    config: TransformerConfig = model.config
    check_exportable(config, model)
    if isinstance(model, TransformerEncoder):
        architecture, task, prefix = "BertModel", "encoder", ""
    elif isinstance(model, MaskedLM):
        architecture, task, prefix = "BertForMaskedLM", "masked_lm", "bert."
    else:
        architecture, task, prefix = "BertForSequenceClassification", "classification", "bert."
    return hf_config(config, architecture), name_map(config, task, prefix,
                                                     has_pooler=task == "classification",
                                                     source_task=task)


def hf_config(config: TransformerConfig, architecture: str) -> dict[str, Any]:
    """The config.json of a BERT-layout checkpoint of ``architecture`` (RoBERTa's too)."""
    return dict(model_type="bert", architectures=[architecture], vocab_size=config.vocab_size,
                hidden_size=config.d_model, num_attention_heads=config.n_heads,
                intermediate_size=config.d_ff, num_hidden_layers=config.n_encoder_layers,
                max_position_embeddings=config.max_length,
                type_vocab_size=config.type_vocab_size,
                hidden_act=AIAYN_ACTIVATIONS[config.activation],
                layer_norm_eps=config.layer_norm_eps, hidden_dropout_prob=config.dropout,
                attention_probs_dropout_prob=config.attention_dropout,
                position_embedding_type="absolute", pad_token_id=config.pad_id,
                tie_word_embeddings=config.tie_output, initializer_range=config.init_std or 0.02,
                id2label={str(i): f"LABEL_{i}" for i in range(config.num_labels)},
                label2id={f"LABEL_{i}": i for i in range(config.num_labels)})
