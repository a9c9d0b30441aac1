"""RoBERTa and XLM-RoBERTa checkpoints (``RobertaModel``, ``RobertaForMaskedLM``,
``RobertaForSequenceClassification`` and their ``XLMRoberta`` twins) <-> aiayn's encoder-only models.

RoBERTa (Liu et al. 2019) is BERT's network (``aiayn.interop.hf_bert``: post-norm, learned positions,
an embedding LayerNorm, GELU) trained differently, with three differences of layout:

- **Positions start after the padding id**: position i of a text is row ``pad_token_id + 1 + i`` of
  the table (rows 0 and 1 are never used by real tokens), so ``max_position_embeddings`` 514 holds
  512 positions. aiayn's learned table with ``position_offset = pad_token_id + 1`` is the same table.
  RoBERTa counts positions over the non-padding tokens only, and so does an encoder with
  ``positions_skip_padding`` (from its padding mask): left-padded text gets the same outputs.
- **The classification head** is ``classifier.dense`` + tanh + ``classifier.out_proj`` on ``<s>``:
  BERT's pooler + classifier, under other names (a bare ``RobertaModel``'s own ``pooler`` is not
  used for classification, as ``transformers`` does not use it).
- **The masked-LM head** is ``lm_head.{dense,layer_norm,decoder,bias}``: BERT's MLM head under other
  names.

So the name map is ``hf_bert``'s under RoBERTa's names (``ROBERTA``, an ``hf_bert.Names``).

XLM-RoBERTa is the same network with a SentencePiece vocabulary (``aiayn.data.wordpiece`` reads its
``tokenizer.json`` and special tokens). An aiayn encoder model with ``position_offset > 0`` is saved
as RoBERTa (``model_type`` roberta).

Legend: D model width, V vocabulary, C classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop import hf_bert
from aiayn.interop.hf_common import Checkpoint, NameMap
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder

MODEL_TYPES = ("roberta", "xlm-roberta")
ARCHITECTURES = {f"{family}{kind}": task for family in ("Roberta", "XLMRoberta")
                 for kind, task in (("Model", "encoder"), ("ForMaskedLM", "masked_lm"),
                                    ("ForSequenceClassification", "classification"))}
ROBERTA = dataclasses.replace(
    hf_bert.BERT, family="RoBERTa", prefix="roberta.",
    pooler="classifier.dense", pooler_in_base=False, classifier="classifier.out_proj",
    mlm_dense="lm_head.dense", mlm_norm="lm_head.layer_norm",
    mlm_bias=("lm_head.bias", "lm_head.decoder.bias"), mlm_projection="lm_head.decoder.weight",
    mlm_keys=r"lm_head\..*")


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint, task: str,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a RoBERTa config.json: BERT's, with the position table offset past the
    padding id (``overrides`` win)."""
    pad = hf.get("pad_token_id")
    offset = (pad if isinstance(pad, int) and pad >= 0 else 1) + 1
    table = hf.get("max_position_embeddings", 514)
    if table <= offset:
        raise ValueError(f"{checkpoint.directory / 'config.json'}: max_position_embeddings={table} "
                         f"leaves no position after the padding id's {offset} rows")
    fields = dict(position_offset=offset, max_length=table - offset, positions_skip_padding=True,
                  type_vocab_size=hf.get("type_vocab_size", 1))
    return hf_bert.config_from_hf(hf, checkpoint, task, {**fields, **overrides})


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    model, name_map = hf_bert.plan_encoder(checkpoint, ARCHITECTURES[architecture], task,
                                           overrides, ROBERTA, config_from_hf)
    # A bare RobertaModel's own pooler serves no task: the classifier's dense layer is its own
    name_map.dropped.append(r"(roberta\.)?pooler\.dense\.(weight|bias)")
    return model, name_map


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    """An encoder-only model whose position table is offset (BERT's starts at row 0)."""
    return (isinstance(model, (TransformerEncoder, MaskedLM, SequenceClassifier))
            and model.config.position_offset > 0)


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn encoder-only model as RoBERTa."""
    config: TransformerConfig = model.config
    if config.position_offset != config.pad_id + 1:
        raise ValueError(f"cannot export as RoBERTa: its positions start at pad_id + 1 = "
                         f"{config.pad_id + 1}, the model's table at position_offset="
                         f"{config.position_offset}")
    hf_bert.check_exportable(config, model, position_offset=config.position_offset,
                             family="RoBERTa")
    kind = {TransformerEncoder: "Model", MaskedLM: "ForMaskedLM",
            SequenceClassifier: "ForSequenceClassification"}[type(model)]
    architecture = f"Roberta{kind}"
    task = ARCHITECTURES[architecture]
    hf = {**hf_bert.hf_config(config, architecture), "model_type": "roberta",
          "max_position_embeddings": config.max_length + config.position_offset,
          "bos_token_id": config.bos_id, "eos_token_id": config.eos_id}
    return hf, hf_bert.name_map(config, task, "" if task == "encoder" else ROBERTA.prefix,
                                has_pooler=task == "classification", source_task=task,
                                names=ROBERTA)
