"""ModernBERT checkpoints (``ModernBertModel``, ``ModernBertForMaskedLM``,
``ModernBertForSequenceClassification``; model_type "modernbert") <-> aiayn's encoder-only models
(``TransformerEncoder``, ``MaskedLM``, ``SequenceClassifier``).

ModernBERT (Warner et al. 2024) is a pre-norm encoder built from the modern decoder's parts, each a
TransformerConfig field:

- **Embeddings**: token embedding -> LayerNorm -> dropout; no position table, rotary positions
  (``positions="rotary"``) in every attention, no sqrt(D) scaling.
- **Layers**: pre-norm with bias-free LayerNorms (``norm_bias`` -> ``layer_norm_bias``), no norm
  before layer 0's attention (``first_attention_norm=False``: the embedding norm precedes it), a
  final norm.
- **Alternating global and local attention**: layer i is global when i % global_attn_every_n_layers
  == 0; the others see only the keys at most local_attention // 2 positions away on either side, as
  transformers' mask writes it (|i - j| <= local_attention // 2): aiayn's encoder ``sliding_window``
  W = local_attention // 2 + 1 on ``sliding_window_layers`` (the band |i - j| < W). The local layers
  turn RoPE with a base of their own (``local_rope_theta`` -> ``rope_local_theta``; the global
  layers' ``global_rope_theta`` -> ``rope_theta``).
- **A gated FFN** (GeGLU) whose ``Wi`` (2F, D) holds both halves: ``input, gate = Wi(x).chunk(2)``,
  ``Wo(act(input) * gate)``; the activated first half is aiayn's ``gate_proj`` (rows :F), the
  linear second half ``up_proj`` (rows F:). ``Wqkv`` (3D, D) is q | k | v, aiayn's ``qkv_proj``.
- **The MLM head** ``head.dense`` (bias: ``classifier_bias`` -> ``head_bias``) ->
  ``classifier_activation`` -> ``head.norm`` -> ``decoder`` (tied to the token embedding, bias
  ``decoder_bias`` -> ``output_bias``): aiayn's MLM transform and projection.
- **The classification head** pools the first token ("cls") or the mean over real tokens ("mean",
  ``classifier_pooling`` -> ``pooling``), then the same dense -> activation -> norm (aiayn's
  pooler with ``pooler_activation`` = ``activation`` and ``pooler_norm``) -> dropout ->
  ``classifier``. The MLM and classification heads share ``head.*``: a masked-LM checkpoint loaded
  for classification keeps its ``head`` and starts the classifier fresh, as transformers does.

Config layouts, read with transformers 5's precedence: ``layer_types`` (transformers 5) when
present, else every ``global_attn_every_n_layers``-th layer global (4.48+; default 3); each layer
type's ``rope_theta`` from ``rope_parameters`` (5) when there, else ``global_rope_theta`` /
``local_rope_theta`` (4), else 160000 / 10000. A null ``local_rope_theta`` (transformers 4: the
local layers use the global base) loads as the global base.

Refused, naming the field: RoPE types other than "default" (``rope_parameters`` or
``rope_scaling``), ``classifier_activation`` other than ``hidden_activation`` for a model with a
head (aiayn's MLM transform and pooler use the model's activation), ``attention_bias`` !=
``mlp_bias`` (aiayn's ``bias`` is both), layer types other than full and sliding attention,
``classifier_pooling`` other than cls and mean. Ignored, as they change no eval-mode output: ``sparse_prediction`` and
``sparse_pred_ignore_index`` (HF's MLM then computes logits only at labelled positions; aiayn's
returns them all, the loss on the labelled ones is the same), ``deterministic_flash_attn``,
``reference_compile``, ``repad_logits_with_grad``, ``initializer_cutoff_factor``.

Dropout (training only) differs: ``embedding_dropout`` -> ``dropout``, which aiayn also applies to
each sub-layer's output and before the classifier (ModernBERT: ``attention_dropout`` on the attention
output, none on the FFN's, ``classifier_dropout`` before the classifier); ``attention_dropout`` ->
``attention_dropout``; ``mlp_dropout`` -> ``activation_dropout``.

``save_pretrained`` writes an encoder-only model with rotary positions as ModernBERT, in both
layouts (``layer_types`` / ``rope_parameters`` and ``global_attn_every_n_layers`` /
``global_rope_theta`` / ``local_rope_theta``), so its local layers must be ModernBERT's pattern
(layer i global iff i % n == 0); other configs are refused naming the field.

Legend: D model width, F feed-forward width, V vocabulary, C classes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop import hf_bert
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, CONFIG_FILE, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder
from aiayn.nn.stacks import sliding_layers

MODEL_TYPES = ("modernbert",)
ARCHITECTURES = {"ModernBertModel": "encoder", "ModernBertForMaskedLM": "masked_lm",
                 "ModernBertForSequenceClassification": "classification"}
TASKS = hf_bert.TASKS
LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # ModernBertConfig's
LEGACY_THETA = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}
POOLINGS = {"cls": "first", "mean": "mean"}


def _count(hf: dict[str, Any], key: str, default: int, source, *, zero: bool = False) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero else 1):
        raise ValueError(f"{source / CONFIG_FILE}: {key}={value!r} must be a "
                         f"{'non-negative' if zero else 'positive'} integer")
    return value


def _layer_types(hf: dict[str, Any], layers: int, source) -> list[str]:
    """Each layer's attention: ``layer_types``, else every n-th layer global from layer 0."""
    types = hf.get("layer_types")
    if types is None:
        every = _count(hf, "global_attn_every_n_layers", 3, source)
        return [LAYER_TYPES[bool(i % every)] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"{source / CONFIG_FILE}: layer_types={types!r} must list "
                         f"{list(LAYER_TYPES)} for each of the {layers} layers")
    return types


def _rope_thetas(hf: dict[str, Any], source) -> dict[str, float]:
    """The RoPE base of each layer type (the module docstring's precedence); scaled RoPE refused."""
    parameters = hf.get("rope_parameters") or {}
    if not isinstance(parameters, dict) or not set(parameters) <= set(LAYER_TYPES):
        raise ValueError(f"{source / CONFIG_FILE}: rope_parameters must map "
                         f"{list(LAYER_TYPES)} to their RoPE settings, got {parameters!r}")
    legacy = hf.get("rope_scaling")
    thetas = {}
    for kind in LAYER_TYPES:
        settings = {**(parameters.get(kind) or {}), **(legacy or {})}
        rope_type = settings.get("rope_type", settings.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source / CONFIG_FILE}: RoPE type {rope_type!r} ({kind}) is not "
                             f"supported for ModernBERT; aiayn loads 'default'")
        theta = settings.get("rope_theta", hf.get(LEGACY_THETA[kind], DEFAULT_THETA[kind]))
        if theta is None and kind == "sliding_attention":  # transformers 4: the global base
            theta = thetas["full_attention"]
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ValueError(f"{source / CONFIG_FILE}: the RoPE base of {kind} layers "
                             f"({LEGACY_THETA[kind]} or rope_parameters) must be a positive "
                             f"number, got {theta!r}")
        thetas[kind] = float(theta)
    return thetas


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint, task: str,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a ModernBERT config.json (``overrides`` win, e.g. ``num_labels``)."""
    source = checkpoint.directory
    layers = require(hf, "num_hidden_layers", source)
    activation = activation_from_hf(hf.get("hidden_activation", "gelu"), "hidden_activation",
                                    source)
    head_activation = hf.get("classifier_activation", "gelu")
    if task != "encoder" and activation_from_hf(head_activation, "classifier_activation",
                                                source) != activation:
        raise ValueError(f"{source / CONFIG_FILE}: classifier_activation={head_activation!r} "
                         f"differs from hidden_activation={hf.get('hidden_activation', 'gelu')!r}; "
                         f"aiayn's heads use the model's activation")
    bias = hf.get("attention_bias", False)
    if hf.get("mlp_bias", False) != bias:
        raise ValueError(f"{source / CONFIG_FILE}: attention_bias={bias!r} and mlp_bias="
                         f"{hf.get('mlp_bias')!r} differ; aiayn's bias sets both")
    pooling = hf.get("classifier_pooling", "cls")
    if pooling not in POOLINGS:
        raise ValueError(f"{source / CONFIG_FILE}: classifier_pooling={pooling!r} is not "
                         f"supported; aiayn pools {sorted(POOLINGS)}")
    types = _layer_types(hf, layers, source)
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    thetas = _rope_thetas(hf, source)
    local = thetas["sliding_attention"]
    window = _count(hf, "local_attention", 128, source, zero=True) // 2 + 1 if sliding else None
    fields = hf_bert.encoder_fields(hf, task, require(hf, "vocab_size", source))
    fields.update(
        d_model=require(hf, "hidden_size", source),
        n_heads=require(hf, "num_attention_heads", source),
        d_ff=require(hf, "intermediate_size", source), n_encoder_layers=layers,
        max_length=hf.get("max_position_embeddings", 8192),
        dropout=hf.get("embedding_dropout", 0.0), attention_dropout=hf.get("attention_dropout", 0.0),
        activation_dropout=hf.get("mlp_dropout", 0.0), activation=activation,
        norm_first=True, final_norm=True, first_attention_norm=False,
        layer_norm_eps=hf.get("norm_eps", 1e-5), layer_norm_bias=hf.get("norm_bias", False),
        bias=bias, gated_ffn=True, embedding_norm=True, type_vocab_size=0,
        positions="rotary", rope_theta=thetas["full_attention"],
        sliding_window=window, sliding_window_layers=sliding or None,
        rope_local_theta=local if sliding and local != thetas["full_attention"] else None,
        output_bias=task == "masked_lm" and hf.get("decoder_bias", True),
        pooling=POOLINGS[pooling], pooler_activation=activation, pooler_norm=True,
        head_bias=hf.get("classifier_bias", False))
    fields.update(overrides)
    return build_config(fields, source)


def name_map(config: TransformerConfig, task: str, prefix: str, *, source_task: str,
             has_head: bool) -> NameMap:
    """How a ModernBERT checkpoint (of ``source_task``, base keys under ``prefix``: "model." or
    "") fills the aiayn ``task`` model; ``has_head``: the checkpoint holds ``head.*``."""
    ours = "encoder." if task == "encoder" else "encoder.encoder."
    n, f = config.n_encoder_layers, config.d_ff
    layer, hf_layer = f"{ours}layers.{{}}.", f"{prefix}layers.{{}}."
    kinds = ("weight", "bias") if config.bias else ("weight",)
    norm_kinds = ("weight", "bias") if config.layer_norm_bias else ("weight",)
    rules = [Rule(f"{ours}embeddings.tokens.weight", (f"{prefix}embeddings.tok_embeddings.weight",))]
    rules += [Rule(f"{ours}{name}.{kind}", (f"{prefix}{hf_name}.{kind}",))
              for name, hf_name in (("embeddings.norm", "embeddings.norm"), ("norm", "final_norm"))
              for kind in norm_kinds]
    for kind in kinds:
        qkv = f"{hf_layer}attn.Wqkv.{kind}"
        if config.fused_projections:  # aiayn's qkv_proj has ModernBERT's rows: q | k | v
            rules.append(Rule(f"{layer}self_attention.qkv_proj.{kind}", (qkv,), n))
        else:
            d = config.d_model
            rules += [Rule(f"{layer}self_attention.{name}_proj.{kind}", (qkv,), n,
                           rows=(i * d, (i + 1) * d)) for i, name in enumerate("qkv")]
        rules += [Rule(f"{layer}self_attention.out_proj.{kind}", (f"{hf_layer}attn.Wo.{kind}",), n),
                  # input, gate = Wi(x).chunk(2): the activated half first
                  Rule(f"{layer}feedforward.gate_proj.{kind}", (f"{hf_layer}mlp.Wi.{kind}",), n,
                       rows=(0, f)),
                  Rule(f"{layer}feedforward.up_proj.{kind}", (f"{hf_layer}mlp.Wi.{kind}",), n,
                       rows=(f, 2 * f)),
                  Rule(f"{layer}feedforward.down_proj.{kind}", (f"{hf_layer}mlp.Wo.{kind}",), n)]
    for kind in norm_kinds:
        rules.append(Rule(f"{layer}feedforward_residual.norm.{kind}",
                          (f"{hf_layer}mlp_norm.{kind}",), n))
        rules += [Rule(f"{ours}layers.{i}.attention_residual.norm.{kind}",  # none on layer 0
                       (f"{prefix}layers.{i}.attn_norm.{kind}",)) for i in range(1, n)]
    ties: list[tuple[str, ...]] = []
    new: list[str] = []
    dropped = [r"classifier\.(weight|bias)"] if source_task == "classification" else []
    head_kinds = ("weight", "bias") if config.head_bias else ("weight",)
    head = {"masked_lm": "head.dense", "classification": "head.pooler"}.get(task)
    if head is None:
        dropped += [r"head\..*", r"decoder\..*"]
    else:  # the MLM and classification heads share ModernBERT's head.dense and head.norm
        transform = [(f"{head}.{kind}", f"head.dense.{kind}") for kind in head_kinds] + \
            [(f"head.norm.{kind}", f"head.norm.{kind}") for kind in norm_kinds]
        if has_head:
            rules += [Rule(target, (key,)) for target, key in transform]
        else:
            new += [target for target, _ in transform]
    if task == "masked_lm":
        if config.tie_output:
            ties.append((f"{prefix}embeddings.tok_embeddings.weight", "decoder.weight"))
        outputs = (["bias"] if config.output_bias else []) + ([] if config.tie_output
                                                               else ["weight"])
        for kind in outputs:
            if source_task == "masked_lm":
                rules.append(Rule(f"head.projection.{kind}", (f"decoder.{kind}",)))
            else:
                new.append(f"head.projection.{kind}")
    elif task == "classification":
        dropped.append(r"decoder\..*")
        if source_task == "classification":
            rules += [Rule(f"head.classifier.{kind}", (f"classifier.{kind}",))
                      for kind in ("weight", "bias")]
        else:
            new += ["head.classifier.weight", "head.classifier.bias"]
    return NameMap(rules, ties=ties, new=new, dropped=dropped)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    source_task = ARCHITECTURES[architecture]
    task = task or source_task
    if task not in TASKS:
        raise ValueError(f"a ModernBERT checkpoint loads as one of {sorted(TASKS)}, not "
                         f"task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, task, overrides)
    prefix = "model." if any(key.startswith("model.") for key in checkpoint.tensors) else ""
    has_head = "head.dense.weight" in checkpoint.tensors
    return TASKS[task](config), name_map(config, task, prefix, source_task=source_task,
                                         has_head=has_head)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    """An encoder-only model with rotary positions (BERT's and RoBERTa's are learned)."""
    return (isinstance(model, (TransformerEncoder, MaskedLM, SequenceClassifier))
            and model.config.positions == "rotary")


EXPORT_REQUIRED = dict(
    norm="layer", norm_first=True, final_norm=True, first_attention_norm=False, positions="rotary",
    rotary_fraction=1.0, rope_scaling=None, gated_ffn=True, embedding_norm=True,
    scale_embeddings=False, type_vocab_size=0, d_head=None, n_kv_heads=None, qkv_bias=None,
    qk_norm=False, sandwich_norm=False, attention_softcap=None, logit_softcap=None,
    relative_attention_buckets=0, scale_attention=True, attention_scale=None, scale_output=False)


def _global_every(config: TransformerConfig) -> int:
    """n such that layer i is global (not sliding) exactly when i % n == 0; refused otherwise."""
    layers = config.n_encoder_layers
    sliding = sliding_layers(config, layers)  # a window slides on some layer (config checks)
    for every in range(1, layers + 1):
        if all(slides == bool(i % every) for i, slides in enumerate(sliding)):
            return every
    raise ValueError(f"cannot export as ModernBERT: its layer i is global exactly when i % n == 0 "
                     f"(global_attn_every_n_layers); the model's sliding layers are "
                     f"{[i for i, slides in enumerate(sliding) if slides]}")


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn encoder-only model as ModernBERT."""
    config: TransformerConfig = model.config
    required = dict(EXPORT_REQUIRED)
    if isinstance(model, SequenceClassifier):
        required.update(pooler=True, pooler_norm=True, pooler_activation=config.activation)
    if isinstance(model, MaskedLM):
        required.update(mlm_transform=True)
    require_fields(config, required, "ModernBERT")
    every = _global_every(config)
    kind = {TransformerEncoder: "Model", MaskedLM: "ForMaskedLM",
            SequenceClassifier: "ForSequenceClassification"}[type(model)]
    task = ARCHITECTURES[f"ModernBert{kind}"]
    window = config.sliding_window
    thetas = {"full_attention": float(config.rope_theta),
              "sliding_attention": float(config.rope_local_theta or config.rope_theta)}
    activation = AIAYN_ACTIVATIONS[config.activation]
    hf = dict(
        model_type="modernbert", architectures=[f"ModernBert{kind}"],
        vocab_size=config.vocab_size, hidden_size=config.d_model,
        intermediate_size=config.d_ff, num_hidden_layers=config.n_encoder_layers,
        num_attention_heads=config.n_heads, hidden_activation=activation,
        classifier_activation=activation, max_position_embeddings=config.max_length,
        norm_eps=config.layer_norm_eps, norm_bias=config.layer_norm_bias,
        attention_bias=config.bias, mlp_bias=config.bias, classifier_bias=config.head_bias,
        decoder_bias=config.output_bias if task == "masked_lm" else True,
        embedding_dropout=config.dropout, attention_dropout=config.attention_dropout,
        mlp_dropout=config.activation_dropout, classifier_dropout=config.dropout,
        classifier_pooling={v: k for k, v in POOLINGS.items()}[config.pooling],
        local_attention=2 * (window - 1) if window is not None else 128,
        global_attn_every_n_layers=every,
        layer_types=[LAYER_TYPES[bool(i % every)] for i in range(config.n_encoder_layers)],
        rope_parameters={layer_type: {"rope_type": "default", "rope_theta": theta}
                         for layer_type, theta in thetas.items()},
        global_rope_theta=thetas["full_attention"], local_rope_theta=thetas["sliding_attention"],
        tie_word_embeddings=config.tie_output, initializer_range=config.init_std or 0.02,
        pad_token_id=config.pad_id, bos_token_id=config.bos_id, cls_token_id=config.bos_id,
        eos_token_id=config.eos_id, sep_token_id=config.eos_id,
        id2label={str(i): f"LABEL_{i}" for i in range(config.num_labels)},
        label2id={f"LABEL_{i}": i for i in range(config.num_labels)})
    return hf, name_map(config, task, "" if task == "encoder" else "model.", source_task=task,
                        has_head=task != "encoder")

