"""ViT checkpoints (``ViTModel``, ``ViTForImageClassification``) <-> aiayn's ``VisionTransformer``
and ``ImageClassifier`` (Dosovitskiy et al. 2021).

HF's ViT is aiayn's encoder stack with pre-norm residuals and a final LayerNorm (``norm_first``,
``final_norm``), GELU, LayerNorm eps 1e-12, learned positions, a strided-convolution patch
embedding and a [CLS] token, and a linear classifier on the final [CLS] state. Each is a
TransformerConfig field; ``image_size``, ``patch_size`` and ``num_channels`` carry over as they are
(square images only).

Files hold the names ``save_pretrained`` writes (``vit.encoder.layer.{}.attention.attention.query``
...), which every ``transformers`` version loads; a model in memory (``from_transformers``) may
have transformers 5's module names (``vit.layers.{}.attention.q_proj`` ...): both are mapped. ViT's
separate query/key/value matrices go into aiayn's fused ``qkv_proj`` (or stay separate with
``fused_projections=False``). A checkpoint loads as ``task="encoder"`` (``VisionTransformer``; a
classifier or pooler in the file is dropped) or ``"classification"`` (``ImageClassifier``; a head
the file lacks is freshly initialised).

Legend: D model width, F feed-forward width, C channels, P patch size, N patches, K classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, CONFIG_FILE, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require, require_fields)
from aiayn.models.vision import ImageClassifier, VisionTransformer

MODEL_TYPES = ("vit",)
ARCHITECTURES = {"ViTModel": "encoder", "ViTForImageClassification": "classification"}
TASKS = {"encoder": VisionTransformer, "classification": ImageClassifier}


def _square(hf: dict[str, Any], key: str, source: Path) -> int:
    """An int field, or a [n, n] pair (HF allows rectangles; aiayn's ViT takes squares)."""
    value = hf.get(key)
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source / CONFIG_FILE}: {key}={value!r} is not supported (aiayn's ViT "
                         f"takes one int: square images and patches)")
    return value


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint, overrides: dict[str, Any]
                   ) -> TransformerConfig:
    """The aiayn config of a ViT config.json (``overrides`` win, e.g. ``num_labels``)."""
    source = checkpoint.directory
    if hf.get("qkv_bias", True) is not True:
        raise ValueError(f"{source / CONFIG_FILE}: qkv_bias={hf['qkv_bias']!r} is not supported "
                         f"(aiayn's projections all have biases or none)")
    d_model = require(hf, "hidden_size", source)
    n_heads = require(hf, "num_attention_heads", source)
    if hf.get("head_dim") not in (None, d_model // n_heads):
        raise ValueError(f"{source / CONFIG_FILE}: head_dim={hf['head_dim']!r} is not supported "
                         f"(aiayn's heads are hidden_size / num_attention_heads wide)")
    labels = hf.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else hf.get("num_labels", 2)
    fields: dict[str, Any] = dict(
        d_model=d_model, n_heads=n_heads, d_ff=require(hf, "intermediate_size", source),
        n_encoder_layers=require(hf, "num_hidden_layers", source), n_decoder_layers=0,
        image_size=_square(hf, "image_size", source), patch_size=_square(hf, "patch_size", source),
        num_channels=hf.get("num_channels", 3), dropout=hf.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        activation=activation_from_hf(hf.get("hidden_act", "gelu"), "hidden_act", source),
        norm_first=True, final_norm=True, layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        positions="learned", init_std=hf.get("initializer_range", 0.02), num_labels=num_labels,
        pooling="first", pooler=False, bias=True)
    fields.update(overrides)
    return build_config(fields, source)


# The names of one layer's parts in the two layouts: the files (what ``save_pretrained`` writes)
# and the modules of transformers >= 5 (what ``from_transformers`` reads from a model in memory).
LAYER_NAMES = {
    "file": dict(layer="encoder.layer.{}.", query="attention.attention.query",
                 key="attention.attention.key", value="attention.attention.value",
                 out="attention.output.dense", fc1="intermediate.dense", fc2="output.dense"),
    "modules": dict(layer="layers.{}.", query="attention.q_proj", key="attention.k_proj",
                    value="attention.v_proj", out="attention.o_proj", fc1="mlp.fc1",
                    fc2="mlp.fc2"),
}


def layout_of(tensors: dict[str, Any], prefix: str) -> str:
    """``"modules"`` when the keys are transformers 5's module names, else ``"file"``."""
    return "modules" if f"{prefix}layers.0.attention.q_proj.weight" in tensors else "file"


def name_map(config: TransformerConfig, task: str, prefix: str, *, source_task: str,
             has_pooler: bool, layout: str = "file") -> NameMap:
    """How a ViT checkpoint (of ``source_task``, keys under ``prefix``, names of ``layout``) fills
    the aiayn model of ``task``."""
    n = config.n_encoder_layers
    names = LAYER_NAMES[layout]
    ours = "" if task == "encoder" else "encoder."
    layer, hf_layer = f"{ours}encoder.layers.{{}}.", prefix + names["layer"]
    rules = [Rule(f"{ours}embeddings.cls_token", (f"{prefix}embeddings.cls_token",)),
             Rule(f"{ours}embeddings.positions", (f"{prefix}embeddings.position_embeddings",))]
    for kind in ("weight", "bias"):
        rules.append(Rule(f"{ours}embeddings.projection.{kind}",
                          (f"{prefix}embeddings.patch_embeddings.projection.{kind}",)))
        if config.fused_projections:
            rules.append(Rule(f"{layer}self_attention.qkv_proj.{kind}",
                              tuple(f"{hf_layer}{names[part]}.{kind}"
                                    for part in ("query", "key", "value")), n))
        else:
            for ours_name, part in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
                rules.append(Rule(f"{layer}self_attention.{ours_name}.{kind}",
                                  (f"{hf_layer}{names[part]}.{kind}",), n))
        for ours_name, hf_name in (("self_attention.out_proj", names["out"]),
                                   ("attention_residual.norm", "layernorm_before"),
                                   ("feedforward.linear1", names["fc1"]),
                                   ("feedforward.linear2", names["fc2"]),
                                   ("feedforward_residual.norm", "layernorm_after")):
            rules.append(Rule(f"{layer}{ours_name}.{kind}", (f"{hf_layer}{hf_name}.{kind}",), n))
        rules.append(Rule(f"{ours}encoder.norm.{kind}", (f"{prefix}layernorm.{kind}",)))
    new: list[str] = []
    dropped: list[str] = []
    if has_pooler:  # ViTModel's dense + tanh on [CLS]: no aiayn ViT has it
        dropped.append(rf"{prefix}pooler\.dense\.(weight|bias)")
    if task == "classification":
        for kind in ("weight", "bias"):
            if source_task == "classification":
                rules.append(Rule(f"head.classifier.{kind}", (f"classifier.{kind}",)))
            else:
                new.append(f"head.classifier.{kind}")
    elif source_task == "classification":
        dropped.append(r"classifier\.(weight|bias)")
    return NameMap(rules, new=new, dropped=dropped)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any]) -> tuple[nn.Module, NameMap]:
    """An initialised aiayn model for ``task`` (default: the checkpoint's own) and its name map."""
    source_task = ARCHITECTURES[architecture]
    task = task or source_task
    if task not in TASKS:
        raise ValueError(f"a ViT checkpoint loads as one of {sorted(TASKS)}, not task={task!r}")
    config = config_from_hf(checkpoint.config, checkpoint, overrides)
    if config.pooler:
        raise ValueError("a ViT checkpoint loads without a pooler: drop pooler=True")
    prefix = "vit." if any(key.startswith("vit.") for key in checkpoint.tensors) else ""
    return TASKS[task](config), name_map(
        config, task, prefix, source_task=source_task,
        has_pooler=f"{prefix}pooler.dense.weight" in checkpoint.tensors,
        layout=layout_of(checkpoint.tensors, prefix))


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, (VisionTransformer, ImageClassifier))


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn ViT as ``ViTModel`` (load it with
    ``add_pooling_layer=False``) or ``ViTForImageClassification``."""
    config: TransformerConfig = model.config
    required = dict(norm_first=True, final_norm=True, bias=True, layer_norm_bias=True,
                    pooling="first", pooler=False)
    require_fields(config, required, "ViT")
    task = "encoder" if isinstance(model, VisionTransformer) else "classification"
    architecture = {"encoder": "ViTModel", "classification": "ViTForImageClassification"}[task]
    hf = dict(model_type="vit", architectures=[architecture], hidden_size=config.d_model,
              num_attention_heads=config.n_heads, intermediate_size=config.d_ff,
              num_hidden_layers=config.n_encoder_layers, image_size=config.image_size,
              patch_size=config.patch_size, num_channels=config.num_channels, qkv_bias=True,
              hidden_act=AIAYN_ACTIVATIONS[config.activation],
              layer_norm_eps=config.layer_norm_eps, hidden_dropout_prob=config.dropout,
              attention_probs_dropout_prob=config.attention_dropout,
              initializer_range=config.init_std or 0.02,
              id2label={str(i): f"LABEL_{i}" for i in range(config.num_labels)},
              label2id={f"LABEL_{i}": i for i in range(config.num_labels)})
    return hf, name_map(config, task, "" if task == "encoder" else "vit.", source_task=task,
                        has_pooler=False)
