"""BERT checkpoints (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``) <-> aiayn's
encoder-only models (``TransformerEncoder``, ``MaskedLM``, ``SequenceClassifier``).

BERT is the paper's encoder (post-norm, 3.1) with: learned positions, segment (token-type) embeddings,
a LayerNorm after the embedding sum, no sqrt(d_model) scaling, erf GELU, LayerNorm eps 1e-12, a
dense + tanh pooler on [CLS] for classification, and an MLM head of dense + GELU + LayerNorm + a
projection tied to the word embeddings with its own bias. Each is a TransformerConfig field.

BERT's separate query/key/value matrices are concatenated into aiayn's fused ``qkv_proj`` (one (3D, D)
matmul), or kept separate with ``fused_projections=False``.

Legend: D model width, F feed-forward width, V vocabulary, C classes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require)
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder

MODEL_TYPES = ("bert",)
ARCHITECTURES = {"BertModel": "encoder", "BertForMaskedLM": "masked_lm",
                 "BertForSequenceClassification": "classification"}
TASKS = {"encoder": TransformerEncoder, "masked_lm": MaskedLM, "classification": SequenceClassifier}


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
    labels = hf.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else hf.get("num_labels", 2)
    vocab_size = require(hf, "vocab_size", source)
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size, d_model=require(hf, "hidden_size", source),
        n_heads=require(hf, "num_attention_heads", source),
        d_ff=require(hf, "intermediate_size", source),
        n_encoder_layers=require(hf, "num_hidden_layers", source), n_decoder_layers=0,
        max_length=hf.get("max_position_embeddings", 512),
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        activation=activation_from_hf(hf.get("hidden_act", "gelu"), "hidden_act", source),
        norm_first=False, final_norm=False, layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        positions="learned", position_offset=0, scale_embeddings=False, embedding_norm=True,
        type_vocab_size=hf.get("type_vocab_size", 2),
        tie_output=hf.get("tie_word_embeddings", True), output_bias=task == "masked_lm",
        init_std=hf.get("initializer_range", 0.02), num_labels=num_labels, pooling="first",
        pooler=task == "classification", mlm_transform=True,
        pad_id=hf.get("pad_token_id") if isinstance(hf.get("pad_token_id"), int) else 0)
    for hf_name, name in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
        value = hf.get(hf_name)
        if isinstance(value, int) and 0 <= value < vocab_size:
            fields[name] = value
    fields.update(overrides)
    return build_config(fields, source)


def _prefix(checkpoint: Checkpoint) -> str:
    # BertModel checkpoints are bare ("embeddings.…"); the head models nest it under "bert.".
    return "bert." if any(key.startswith("bert.") for key in checkpoint.tensors) else ""


def encoder_rules(config: TransformerConfig, ours: str, hf: str) -> list[Rule]:
    """Rules for the embeddings and the layer stack; ``ours``/``hf`` are the two name prefixes."""
    n = config.n_encoder_layers
    layer, hf_layer = f"{ours}layers.{{}}.", f"{hf}encoder.layer.{{}}."
    attention = f"{hf_layer}attention.self."
    rules = [Rule(f"{ours}embeddings.tokens.weight", (f"{hf}embeddings.word_embeddings.weight",)),
             Rule(f"{ours}embeddings.positions.weight",
                  (f"{hf}embeddings.position_embeddings.weight",))]
    if config.type_vocab_size:
        rules.append(Rule(f"{ours}embeddings.token_types.weight",
                          (f"{hf}embeddings.token_type_embeddings.weight",)))
    for kind in ("weight", "bias"):
        rules.append(Rule(f"{ours}embeddings.norm.{kind}", (f"{hf}embeddings.LayerNorm.{kind}",)))
        if config.fused_projections:
            rules.append(Rule(f"{layer}self_attention.qkv_proj.{kind}",
                              tuple(f"{attention}{name}.{kind}" for name in ("query", "key", "value")),
                              n))
        else:
            for ours_name, hf_name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
                rules.append(Rule(f"{layer}self_attention.{ours_name}.{kind}",
                                  (f"{attention}{hf_name}.{kind}",), n))
        for ours_name, hf_name in (("self_attention.out_proj", "attention.output.dense"),
                                   ("attention_residual.norm", "attention.output.LayerNorm"),
                                   ("feedforward.linear1", "intermediate.dense"),
                                   ("feedforward.linear2", "output.dense"),
                                   ("feedforward_residual.norm", "output.LayerNorm")):
            rules.append(Rule(f"{layer}{ours_name}.{kind}", (f"{hf_layer}{hf_name}.{kind}",), n))
    return rules


def name_map(config: TransformerConfig, task: str, prefix: str, *, has_pooler: bool,
             source_task: str) -> NameMap:
    """How a BERT checkpoint (of ``source_task``, keys under ``prefix``) fills the aiayn ``task`` model."""
    ours = "encoder." if task == "encoder" else "encoder.encoder."
    rules = encoder_rules(config, ours, prefix)
    ties: list[tuple[str, ...]] = []
    new: list[str] = []
    dropped: list[str] = []
    if task == "classification":
        for kind in ("weight", "bias"):
            if has_pooler:
                rules.append(Rule(f"head.pooler.{kind}", (f"{prefix}pooler.dense.{kind}",)))
            else:
                new.append(f"head.pooler.{kind}")
            if source_task == "classification":
                rules.append(Rule(f"head.classifier.{kind}", (f"classifier.{kind}",)))
            else:
                new.append(f"head.classifier.{kind}")
    elif has_pooler:  # the encoder and the MLM head have no pooler: BERT's is unused for them
        dropped.append(rf"{prefix}pooler\.dense\.(weight|bias)")
    if task == "masked_lm":
        ties.append(("cls.predictions.bias", "cls.predictions.decoder.bias"))
        if config.tie_output:
            ties.append((f"{prefix}embeddings.word_embeddings.weight",
                         "cls.predictions.decoder.weight"))
        head = {"head.dense": "cls.predictions.transform.dense",
                "head.norm": "cls.predictions.transform.LayerNorm"}
        if source_task == "masked_lm":
            rules += [Rule(f"{ours_name}.{kind}", (f"{hf_name}.{kind}",))
                      for ours_name, hf_name in head.items() for kind in ("weight", "bias")]
            rules.append(Rule("head.projection.bias", ("cls.predictions.bias",)))
            if not config.tie_output:
                rules.append(Rule("head.projection.weight", ("cls.predictions.decoder.weight",)))
        else:
            new += [f"{name}.{kind}" for name in head for kind in ("weight", "bias")]
            new.append("head.projection.bias")
            if not config.tie_output:
                new.append("head.projection.weight")
    elif source_task == "masked_lm":
        dropped.append(r"cls\..*")
    if source_task == "classification" and task != "classification":
        dropped.append(r"classifier\.(weight|bias)")
    return NameMap(rules, ties=ties, ignore=[rf"{prefix}embeddings\.position_ids"], new=new,
                   dropped=dropped)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    source_task = ARCHITECTURES[architecture]
    task = task or source_task
    if task not in TASKS:
        raise ValueError(f"a BERT checkpoint loads as one of {sorted(TASKS)}, not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, task, overrides)
    prefix = _prefix(checkpoint)
    has_pooler = f"{prefix}pooler.dense.weight" in checkpoint.tensors
    return TASKS[task](config), name_map(config, task, prefix, has_pooler=has_pooler,
                                         source_task=source_task)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, (TransformerEncoder, MaskedLM, SequenceClassifier))


def _check_exportable(config: TransformerConfig, model: nn.Module) -> None:
    required = dict(norm_first=False, final_norm=False, positions="learned", position_offset=0,
                    scale_embeddings=False, embedding_norm=True, bias=True)
    if isinstance(model, SequenceClassifier):
        required.update(pooler=True, pooling="first")
    if isinstance(model, MaskedLM):
        required.update(mlm_transform=True, output_bias=True)
    for name, value in required.items():
        if getattr(config, name) != value:
            raise ValueError(f"cannot export as BERT: BERT needs {name}={value!r}, the model has "
                             f"{name}={getattr(config, name)!r}")
    if not config.type_vocab_size:
        raise ValueError("cannot export as BERT: BERT needs token-type embeddings "
                         "(type_vocab_size > 0), the model has type_vocab_size=0")


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn encoder-only model as BERT."""
    config: TransformerConfig = model.config
    _check_exportable(config, model)
    if isinstance(model, TransformerEncoder):
        architecture, task, prefix = "BertModel", "encoder", ""
    elif isinstance(model, MaskedLM):
        architecture, task, prefix = "BertForMaskedLM", "masked_lm", "bert."
    else:
        architecture, task, prefix = "BertForSequenceClassification", "classification", "bert."
    hf = dict(model_type="bert", architectures=[architecture], vocab_size=config.vocab_size,
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
    return hf, name_map(config, task, prefix, has_pooler=task == "classification",
                        source_task=task)
