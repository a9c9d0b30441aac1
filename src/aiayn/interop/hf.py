"""``from_pretrained`` / ``save_pretrained``: Hugging Face checkpoint directories <-> aiayn models.

Families (one module each, each with an explicit parameter-name map):

    config.json model_type   architectures                                  aiayn model
    bert                     BertModel / BertForMaskedLM /                  TransformerEncoder / MaskedLM /
                             BertForSequenceClassification                  SequenceClassifier
    distilbert               DistilBertModel / DistilBertForMaskedLM /      as BERT (no token types,
                             DistilBertForSequenceClassification            ReLU pooler; load only)
    roberta, xlm-roberta     RobertaModel / RobertaForMaskedLM /            as BERT (positions offset
                             RobertaForSequenceClassification (and          past the padding id)
                             the XLMRoberta classes)
    modernbert               ModernBertModel / ModernBertForMaskedLM /      as BERT (pre-norm, rotary,
                             ModernBertForSequenceClassification            GeGLU, local layers)
    deberta-v2               DebertaV2Model / DebertaV2ForMaskedLM /        as BERT (disentangled
                             DebertaV2ForSequenceClassification             attention; v2 and v3)
    gpt2                     GPT2Model / GPT2LMHeadModel                    CausalLM
    llama                    LlamaModel / LlamaForCausalLM                  CausalLM (rotary positions)
    mistral, qwen2, qwen3    MistralForCausalLM / Qwen2ForCausalLM /        CausalLM (as Llama, with
                             Qwen3ForCausalLM (and ...Model)                sliding_window /
                                                                            qkv_bias / qk_norm)
    phi3                     Phi3ForCausalLM / Phi3Model                    CausalLM (as Llama;
                                                                            fused qkv and gate_up
                                                                            weights; written when
                                                                            asked for)
    gemma3_text              Gemma3ForCausalLM / Gemma3TextModel            CausalLM (sandwich norms,
                                                                            local RoPE, windows)
    gemma2, gemma            Gemma2ForCausalLM / GemmaForCausalLM           CausalLM (Gemma 2: sandwich
                             (and ...Model)                                 norms, windows, soft-caps)
    marian, bart             MarianMTModel / BartForConditionalGeneration   Transformer
                             (MarianModel / BartModel)
    mbart, m2m_100           MBartForConditionalGeneration /                Transformer (pre-norm;
                             M2M100ForConditionalGeneration (NLLB-200)      mBART-50, M2M100, NLLB)
                             (MBartModel / M2M100Model)
    vit                      ViTModel / ViTForImageClassification           VisionTransformer /
                                                                            ImageClassifier
    t5                       T5ForConditionalGeneration / T5Model           Transformer (relative bias)

Loading reads config.json and the safetensors (or weights-only ``pytorch_model.bin``) directly: it does
not need ``transformers``. Saving writes files that ``transformers`` loads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop import (hf_bert, hf_deberta, hf_distilbert, hf_gemma, hf_gpt2, hf_llama,
                           hf_marian, hf_modernbert, hf_multilingual, hf_phi3, hf_roberta, hf_t5,
                           hf_vit)
from aiayn.interop.hf_common import (CONFIG_FILE, Checkpoint, load_state, read_checkpoint,
                                     read_config)
from aiayn.interop.hf_export import export_state, write_checkpoint
from aiayn.nn.attention.kernels import make_kernel

# Saving takes the first family that ``matches`` the model: the specific before the general
# (hf_distilbert loads only: it matches no model; hf_phi3 matches what hf_llama matches, so it
# writes only when ``save_pretrained`` is asked for its model_type).
FAMILIES = (hf_deberta, hf_modernbert, hf_roberta, hf_bert, hf_distilbert, hf_gemma, hf_llama,
            hf_phi3, hf_gpt2, hf_t5, hf_multilingual, hf_marian, hf_vit)
# Families whose HF classes have only the paper's blocks (no RMSNorm, gated FFN, grouped-query
# attention, head width of its own, relative bias or extra scales): ``PAPER_BLOCKS`` must hold.
PAPER_FAMILIES = (hf_roberta, hf_bert, hf_gpt2, hf_multilingual, hf_marian, hf_vit)
PAPER_BLOCKS = dict(norm="layer", layer_norm_bias=True, gated_ffn=False, d_head=None,
                    n_kv_heads=None, relative_attention_buckets=0, scale_attention=True,
                    attention_scale=None, scale_output=False, sliding_window=None,
                    first_attention_norm=True, disentangled_attention=None, qk_norm=False,
                    sandwich_norm=False, attention_softcap=None, logit_softcap=None)
TASKS = ("encoder", "masked_lm", "classification", "causal_lm", "seq2seq")


def _family(config: dict[str, Any], directory: Path):
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.MODEL_TYPES:
            return family
    supported = sorted(t for family in FAMILIES for t in family.MODEL_TYPES)
    raise ValueError(f"{directory / CONFIG_FILE}: model_type={model_type!r} is not supported; aiayn "
                     f"loads {', '.join(supported)}")


def _architecture(config: dict[str, Any], family, directory: Path) -> str:
    names = config.get("architectures") or [next(iter(family.ARCHITECTURES))]
    if not isinstance(names, list) or names[0] not in family.ARCHITECTURES:
        raise ValueError(f"{directory / CONFIG_FILE}: architectures={names!r} is not supported; "
                         f"aiayn loads {', '.join(family.ARCHITECTURES)}")
    return names[0]


def checkpoint_task(path: str | Path) -> str:
    """The aiayn model task of an HF checkpoint directory (one of ``TASKS``), from its config.json
    alone: what ``from_pretrained(path)`` builds. Commands use it to pick what to do with a
    directory, so every family in ``FAMILIES`` (and any added later) is served the same way.

    Raises:
        FileNotFoundError / ValueError: as ``from_pretrained`` for the directory and config.json.
    """
    directory = Path(path)
    config = read_config(directory)
    family = _family(config, directory)
    return family.ARCHITECTURES[_architecture(config, family, directory)]


def from_pretrained(path: str | Path, *, task: str | None = None,
                    dtype: torch.dtype | None = None, **overrides: Any) -> nn.Module:
    """Load an HF-format checkpoint directory into the matching aiayn model, in eval mode.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` (or shards with
            ``model.safetensors.index.json``, or ``pytorch_model.bin``, read with weights_only=True).
        task: which aiayn model to build; default the checkpoint's own. BERT (and DistilBERT)
            checkpoints also load as ``"encoder"``, ``"masked_lm"`` or ``"classification"``
            whatever head they were saved with: a head the checkpoint lacks is freshly initialised
            (e.g. a classifier on ``BertModel`` weights, for fine-tuning), a head the model lacks
            is dropped. ViT checkpoints load as ``"encoder"`` (``VisionTransformer``) or
            ``"classification"`` (``ImageClassifier``).
        dtype: cast the loaded model to this dtype (default: float32, as built).
        **overrides: TransformerConfig fields to set on top of the translated config (e.g.
            ``num_labels=3``, ``dropout=0.0``, ``attention="reference"``, ``fused_projections=False``).

    Returns:
        ``TransformerEncoder``, ``MaskedLM``, ``SequenceClassifier``, ``CausalLM``, ``Transformer``,
        ``VisionTransformer`` or ``ImageClassifier``.

    Raises:
        FileNotFoundError: the directory, config.json or the weights are missing.
        ValueError: unsupported model_type/architecture/config option, a truncated or corrupt weights
            file, a missing or unexpected key, or a shape mismatch (naming the file and key).
    """
    directory = Path(path)
    config = read_config(directory)  # checks model_type before reading large weights
    family = _family(config, directory)
    architecture = _architecture(config, family, directory)
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TransformerConfig)})
    if unknown:
        raise ValueError(f"unknown TransformerConfig field(s) in overrides: {', '.join(unknown)}")
    checkpoint = read_checkpoint(directory)
    model, name_map = family.plan(checkpoint, architecture, task, overrides)
    load_state(model, checkpoint, name_map)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def from_transformers(hf_model: nn.Module, *, task: str | None = None,
                      **overrides: Any) -> nn.Module:
    """An aiayn model with the weights of an in-memory ``transformers`` model (no files written).

    Same families, name maps and checks as ``from_pretrained``; handy for side-by-side benchmarks.

    Raises:
        ValueError: as ``from_pretrained`` (unsupported family, missing/unexpected keys, shapes).
    """
    config = hf_model.config.to_dict()
    config["architectures"] = [type(hf_model).__name__]
    source = Path(f"<in-memory {type(hf_model).__name__}>")
    family = _family(config, source)
    architecture = _architecture(config, family, source)
    if task is not None and task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    tensors = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    checkpoint = Checkpoint(source, config, tensors, {})
    model, name_map = family.plan(checkpoint, architecture, task, overrides)
    load_state(model, checkpoint, name_map)
    return model.to(next(hf_model.parameters()).dtype).eval()


def save_pretrained(model: nn.Module, path: str | Path, *, model_type: str | None = None) -> Path:
    """Write an aiayn model as an HF checkpoint directory (config.json + model.safetensors).

    ``TransformerEncoder``/``MaskedLM``/``SequenceClassifier`` are written as BERT (as RoBERTa with
    an offset position table, as ModernBERT with rotary positions, as DeBERTa-v2 with disentangled
    attention), ``CausalLM`` as
    ``LlamaForCausalLM`` (rotary positions) or ``GPT2LMHeadModel``, ``Transformer`` as
    ``T5ForConditionalGeneration`` (a relative position bias), ``MarianMTModel`` (sinusoidal
    "split" positions) or ``BartForConditionalGeneration`` (learned positions with offset 2 and
    an embedding LayerNorm), a pre-norm one as ``MBartForConditionalGeneration`` or
    ``M2M100ForConditionalGeneration`` (fairseq sinusoidal positions), ``VisionTransformer`` /
    ``ImageClassifier`` as ``ViTModel`` / ``ViTForImageClassification``.
    ``transformers.AutoModel*.from_pretrained(path)`` then reproduces the model's outputs.
    Files are written atomically (temporary file, fsync, rename).

    Args:
        model_type: the config.json ``model_type`` to write, for a model that more than one family
            expresses: ``"phi3"`` writes a rotary ``CausalLM`` as ``Phi3ForCausalLM`` (fused
            projections), which is otherwise written as Llama or Mistral. None: chosen from the
            model's config, as above.

    Raises:
        ValueError: the model's config has a feature the HF family cannot express (the message
            names the field), the model is not an aiayn model of these families, or it cannot be
            written as ``model_type``.
    """
    family = _export_family(model, model_type)
    config = getattr(model, "config", None)
    if isinstance(config, TransformerConfig) and not make_kernel(config).exact_softmax:
        raise ValueError(f"cannot export attention={config.attention!r}: transformers' models "
                         f"compute exact softmax attention (fused, reference or chunked)")
    if family in PAPER_FAMILIES:
        _require_paper_blocks(model.config, family.MODEL_TYPES[0])
    hf_config, name_map = family.export(model)
    if model_type is not None and hf_config["model_type"] != model_type:
        raise ValueError(f"cannot export as {model_type}: the model's config is written as "
                         f"{hf_config['model_type']}")
    tensors = export_state(model, name_map)
    tensors.update(getattr(family, "extra_tensors", lambda m: {})(model))
    directory = Path(path)
    write_checkpoint(directory, hf_config, tensors)
    return directory


def _export_family(model: nn.Module, model_type: str | None):
    """The family that writes ``model``: the first that ``matches`` it, or the one that loads
    ``model_type``."""
    if model_type is None:
        family = next((family for family in FAMILIES if family.matches(model)), None)
        if family is None:
            raise ValueError(f"save_pretrained exports aiayn TransformerEncoder, MaskedLM, "
                             f"SequenceClassifier, CausalLM, Transformer, VisionTransformer and "
                             f"ImageClassifier, not {type(model).__name__}")
        return family
    family = next((family for family in FAMILIES if model_type in family.MODEL_TYPES), None)
    if family is None:
        supported = sorted(t for family in FAMILIES for t in family.MODEL_TYPES)
        raise ValueError(f"model_type={model_type!r} is not one aiayn writes; it writes "
                         f"{', '.join(supported)}")
    if not family.matches(model):
        raise ValueError(f"cannot export as {model_type}: a {type(model).__name__} with this "
                         f"config is not a model of that family")
    return family


def _require_paper_blocks(config: TransformerConfig, family: str) -> None:
    for name, value in PAPER_BLOCKS.items():
        current = getattr(config, name)
        if current != value and not (name == "n_kv_heads" and current == config.n_heads):
            raise ValueError(f"cannot export as {family}: it needs {name}={value!r}, the model has "
                             f"{name}={current!r}")
