"""The multilingual translation checkpoints: mBART / mBART-50 (``MBartForConditionalGeneration``)
and M2M100 / NLLB-200 (``M2M100ForConditionalGeneration``) <-> aiayn's encoder-decoder
``Transformer``.

Both are BART (``aiayn.interop.hf_marian``: the same weight names, separate q/k/v projections fused
here) made pre-norm, as fairseq trains its big models: ``norm_first=True`` with a final LayerNorm
after each stack (``encoder.layer_norm`` / ``decoder.layer_norm`` -> ``final_norm``). They differ in:

    mBART (modeling_mbart.py)                           M2M100, NLLB (modeling_m2m_100.py)
    learned positions, table indexed from 2             fixed sinusoidal positions, not saved:
      (``position_offset=2``)                             sin | cos halves with tensor2tensor's
    ``layernorm_embedding`` (``embedding_norm``)           frequencies 10000^(-i / (D/2 - 1))
    GELU; ``final_logits_bias`` (``output_bias``)           (``sinusoid_layout="fairseq"``), position p
    embeddings * sqrt(D) when scale_embedding             at row p + pad + 1 (``position_offset``)
      (true for mbart-large-50)                         no embedding LayerNorm, no logits bias, ReLU,
                                                         embeddings * sqrt(D) (scale_embedding)

M2M100 numbers positions over the non-pad tokens (fairseq's ``make_positions``): a pad token reads
the table's zero row, the others pad + 1 + their index among the non-pad tokens. With right-padded
rows, as aiayn batches them, the real tokens sit at 0 .. n - 1 either way, and the pad tokens are
masked out of every attention, so aiayn's contiguous positions give the same outputs at the real
tokens; with a cache, HF counts on from the cached length, as aiayn does.

Generation (``aiayn.interop.hf_languages``): the decoder starts from </s> (decoder_start_token_id 2)
and the target language code is forced as the first generated token (``forced_bos_token_id``);
mBART's own tokenizer (mbart-large-cc25) starts the decoder from the target code instead.

Legend: D model width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.interop import hf_marian
from aiayn.interop.hf_common import (CONFIG_FILE, Checkpoint, NameMap, activation_from_hf, require,
                                     require_fields)
from aiayn.models import Transformer

MODEL_TYPES = ("mbart", "m2m_100")
ARCHITECTURES = {"MBartForConditionalGeneration": "seq2seq", "MBartModel": "seq2seq",
                 "M2M100ForConditionalGeneration": "seq2seq", "M2M100Model": "seq2seq"}


def _flavour_fields(hf: dict[str, Any], source) -> dict[str, Any]:
    """What mBART or M2M100 changes in BART's translated config."""
    pad = require(hf, "pad_token_id", source)
    fields: dict[str, Any] = dict(norm_first=True, final_norm=True)
    if hf["model_type"] == "m2m_100":
        fields.update(positions="sinusoidal", sinusoid_layout="fairseq", position_offset=pad + 1,
                      positions_skip_padding=True, embedding_norm=False, output_bias=False,
                      output_bias_buffer=False,
                      activation=activation_from_hf(
                          hf.get("activation_function", "relu"), "activation_function", source))
    else:  # transformers' generate starts from bos when the config names no decoder start
        start, bos = hf.get("decoder_start_token_id"), hf.get("bos_token_id")
        if not isinstance(start, int) and isinstance(bos, int):
            fields.update(decoder_start_id=bos, bos_id=bos)
    return fields


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of an mBART or M2M100 config.json (``overrides`` win)."""
    source = checkpoint.directory
    if hf.get("model_type") == "m2m_100":  # M2M100Config's defaults where config.json is silent
        hf = {"activation_function": "relu", "scale_embedding": True,
              **{key: value for key, value in hf.items() if value is not None}}
    base = hf_marian.config_from_hf({**hf, "model_type": "bart"}, checkpoint, {})
    fields = {**_flavour_fields(hf, source), **overrides}
    try:
        return base.replace(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source / CONFIG_FILE}: {error}") from None


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    return hf_marian.plan(checkpoint, architecture, task, overrides, make_config=config_from_hf,
                          family="mBART/M2M100")


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    """A pre-norm ``Transformer`` without T5's relative bias (post-norm ones are Marian/BART)."""
    return (isinstance(model, Transformer) and model.config.norm_first
            and model.config.relative_attention_buckets == 0)


def _flavour(config: TransformerConfig) -> str:
    return hf_marian.pick_flavour(config, {
        "mbart": dict(positions="learned", position_offset=2, embedding_norm=True,
                      positions_skip_padding=False),
        "m2m_100": dict(positions="sinusoidal", sinusoid_layout="fairseq",
                        position_offset=config.pad_id + 1, embedding_norm=False,
                        output_bias=False, positions_skip_padding=True)})


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write a pre-norm aiayn ``Transformer`` as mBART or
    M2M100."""
    config: TransformerConfig = model.config
    flavour = _flavour(config)
    # one vocabulary; its encoder and decoder matrices may differ only with an untied head
    # (transformers 5 then saves each on its own)
    require_fields(config, dict(norm_first=True, final_norm=True, bias=True, type_vocab_size=0,
                                layer_norm_eps=1e-5, src_vocab_size=config.vocab_size,
                                tie_source_target=True if config.tie_output else
                                config.tie_source_target), flavour)
    hf = dict(model_type=flavour, **hf_marian.hf_fields(config), bos_token_id=config.bos_id)
    hf["architectures"] = ["MBartForConditionalGeneration" if flavour == "mbart"
                           else "M2M100ForConditionalGeneration"]
    return hf, hf_marian.name_map(config, "model.", has_head=True,
                                  untied_layout=not config.tie_output)


def extra_tensors(model: nn.Module) -> dict[str, Tensor]:
    """mBART's ``final_logits_bias`` of zeros when the model has no output bias (M2M100 has none),
    and ``shared`` (unused by HF's forward) in the untied layout."""
    config: TransformerConfig = model.config
    extra = {}
    if not config.output_bias and config.positions == "learned":
        extra["final_logits_bias"] = torch.zeros(1, config.vocab_size)
    if not config.tie_output:
        extra["model.shared.weight"] = model.encoder.embeddings.tokens.weight.detach().clone()
    return extra
