"""DistilBERT checkpoints (``DistilBertModel``, ``DistilBertForMaskedLM``,
``DistilBertForSequenceClassification``) -> aiayn's encoder-only models (``TransformerEncoder``,
``MaskedLM``, ``SequenceClassifier``).

DistilBERT (Sanh et al. 2019) is BERT's network (``aiayn.interop.hf_bert``: post-norm, learned
positions, an embedding LayerNorm, GELU, LayerNorm eps 1e-12 fixed in its code) distilled to fewer
layers, with BERT's name map under other names and three differences:

- **No token-type embeddings** (``type_vocab_size=0``).
- **The classification head** is ``pre_classifier`` + **ReLU** + dropout + ``classifier`` on the
  first token: BERT's pooler with another activation (``pooler_activation="relu"``). It belongs to
  the head, so a ``DistilBertModel`` loaded for classification starts it fresh, as
  ``transformers`` does.
- **The masked-LM head** is ``vocab_transform`` + activation + ``vocab_layer_norm`` +
  ``vocab_projector`` (tied to the word embeddings, with its own bias): BERT's MLM head.

``sinusoidal_pos_embds=True`` checkpoints keep their (fixed-sinusoid) table in
``position_embeddings.weight`` like a learned one, and ``transformers`` reads it from the file: aiayn
loads it as a learned table (trainable when fine-tuned, as in transformers 5).
``tie_weights_`` (an old key) is ignored, as ``transformers`` ignores it; ``tie_word_embeddings``
decides. Loading only: aiayn encoder models are saved as BERT (``hf_bert``), never as DistilBERT.

Two dropouts differ, so training (not eval-mode outputs) differs from ``transformers``: DistilBERT
has none on the attention output before its residual sum (aiayn's blocks, like BERT's, apply
``dropout`` there), and its head drops ``seq_classif_dropout`` (aiayn's head: ``dropout``).

Legend: D model width, V vocabulary, C classes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop import hf_bert
from aiayn.interop.hf_common import Checkpoint, NameMap, activation_from_hf, build_config, require

MODEL_TYPES = ("distilbert",)
ARCHITECTURES = {"DistilBertModel": "encoder", "DistilBertForMaskedLM": "masked_lm",
                 "DistilBertForSequenceClassification": "classification"}
TASKS = hf_bert.TASKS
LAYER_NORM_EPS = 1e-12  # fixed in transformers' modeling_distilbert.py, not a config.json field

NAMES = hf_bert.Names(
    family="DistilBERT", prefix="distilbert.",
    embeddings={"tokens": "embeddings.word_embeddings",
                "positions": "embeddings.position_embeddings", "norm": "embeddings.LayerNorm"},
    layer="transformer.layer.{}.",
    qkv=("attention.q_lin", "attention.k_lin", "attention.v_lin"),
    sublayers={"self_attention.out_proj": "attention.out_lin",
               "attention_residual.norm": "sa_layer_norm",
               "feedforward.linear1": "ffn.lin1",
               "feedforward.linear2": "ffn.lin2",
               "feedforward_residual.norm": "output_layer_norm"},
    pooler="pre_classifier", pooler_in_base=False, classifier="classifier",
    mlm_dense="vocab_transform", mlm_norm="vocab_layer_norm", mlm_bias=("vocab_projector.bias",),
    mlm_projection="vocab_projector.weight", mlm_keys=r"vocab_(transform|layer_norm|projector)\..*")


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint, task: str,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a DistilBERT config.json (``overrides`` win, e.g. ``num_labels``)."""
    source = checkpoint.directory
    fields = hf_bert.encoder_fields(hf, task, require(hf, "vocab_size", source))
    fields.update(
        d_model=require(hf, "dim", source), n_heads=require(hf, "n_heads", source),
        d_ff=require(hf, "hidden_dim", source), n_encoder_layers=require(hf, "n_layers", source),
        max_length=hf.get("max_position_embeddings", 512), dropout=hf.get("dropout", 0.1),
        attention_dropout=hf.get("attention_dropout", 0.1),
        activation=activation_from_hf(hf.get("activation", "gelu"), "activation", source),
        layer_norm_eps=LAYER_NORM_EPS, type_vocab_size=0, pooler_activation="relu")
    fields.update(overrides)
    if fields["type_vocab_size"]:
        raise ValueError(f"{source / 'config.json'}: DistilBERT has no token-type embeddings, so "
                         f"type_vocab_size={fields['type_vocab_size']!r} cannot be loaded (only 0)")
    return build_config(fields, source)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    return hf_bert.plan_encoder(checkpoint, ARCHITECTURES[architecture], task, overrides, NAMES,
                                config_from_hf)


def matches(model: nn.Module) -> bool:
    """Never: aiayn saves encoder-only models as BERT (``hf_bert.export``), not as DistilBERT."""
    return False
