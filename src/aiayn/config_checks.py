"""The checks every ``TransformerConfig`` passes on construction: each field's type and range, and
the combinations the model cannot build (a window with linear attention, a relative bias beside
absolute positions, ...). A failed check is a ValueError naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from aiayn.nn.attention.kernels import KERNELS
from aiayn.nn.disentangled import disentangled_spec
from aiayn.nn.rotary import check_rope_scaling

if TYPE_CHECKING:
    from aiayn.config import TransformerConfig

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
POSITION_KINDS = ("sinusoidal", "learned", "rotary", "none")
NORMS = ("layer", "rms")
SINUSOID_LAYOUTS = ("interleaved", "split", "fairseq")
POOLINGS = ("first", "mean")
POOLER_ACTIVATIONS = ("tanh", *ACTIVATIONS)
SPARSE_PATTERNS = ("local", "strided", "local+strided")


def validate(config: TransformerConfig) -> None:
    """Raise ValueError naming the first field of ``config`` that is out of range or contradicts
    another (``TransformerConfig.__post_init__`` calls it after filling the derived fields)."""
    for field in dataclasses.fields(config):  # a flag from JSON as "false" would read as true
        value = getattr(config, field.name)
        if field.type in ("bool", "bool | None") and not (
                isinstance(value, bool) or (value is None and field.type != "bool")):
            none = " or None" if field.type != "bool" else ""
            raise ValueError(f"{field.name} must be true or false{none}, got {value!r}")
    for name in ("vocab_size", "src_vocab_size", "d_model", "n_heads", "d_ff", "max_length",
                 "num_labels", "attention_window", "attention_stride", "attention_chunk_size",
                 "image_size", "patch_size", "num_channels"):
        value = getattr(config, name)
        if not is_count(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    count = config.attention_stride_count
    if count is not None and not is_count(count):
        raise ValueError(f"attention_stride_count must be a positive integer or None, "
                         f"got {count!r}")
    for name in ("n_encoder_layers", "n_decoder_layers", "type_vocab_size", "position_offset"):
        value = getattr(config, name)
        if not is_count(value, zero=True):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if config.image_size % config.patch_size:
        raise ValueError(f"patch_size ({config.patch_size}) must divide image_size "
                         f"({config.image_size}): the ViT cuts images into whole patches")
    if config.d_head is None and config.d_model % config.n_heads:
        raise ValueError(
            f"d_model ({config.d_model}) must be divisible by n_heads ({config.n_heads}), or set "
            f"d_head")
    for name in ("dropout", "attention_dropout", "activation_dropout"):
        value = getattr(config, name)
        if not is_number(value) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if config.init_std is not None and not _is_positive(config.init_std):
        raise ValueError(f"init_std must be positive or None, got {config.init_std!r}")
    if config.scaled_residual_init and config.init_std is None:
        raise ValueError("scaled_residual_init scales init_std (GPT-2's residual projections): "
                         "it needs init_std, got None")
    if not _is_positive(config.layer_norm_eps):
        raise ValueError(f"layer_norm_eps must be positive, got {config.layer_norm_eps!r}")
    _check_choice("activation", config.activation, ACTIVATIONS)
    _check_choice("positions", config.positions, POSITION_KINDS)
    for name in ("positions_skip_padding", "position_offset"):
        if getattr(config, name) and config.positions not in ("learned", "sinusoidal"):
            raise ValueError(f"{name} numbers the rows of a position table; "
                             f"positions={config.positions!r} has none")
    _check_choice("sinusoid_layout", config.sinusoid_layout, SINUSOID_LAYOUTS)
    _check_choice("pooling", config.pooling, POOLINGS)
    _check_choice("pooler_activation", config.pooler_activation, POOLER_ACTIVATIONS)
    _check_choice("attention", config.attention, tuple(KERNELS))
    _check_choice("attention_pattern", config.attention_pattern, SPARSE_PATTERNS)
    if config.attention in ("linear", "chunked") and config.attention_dropout > 0:
        raise ValueError(f"attention_dropout must be 0 with attention={config.attention!r} (it "
                         f"never forms the attention weights), got {config.attention_dropout!r}")
    if config.positions == "sinusoidal" and config.d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {config.d_model}")
    _check_modern(config)
    _check_t5(config)
    _check_attention_scale(config)
    disentangled_spec(config)
    for name in ("pad_id", "bos_id", "eos_id", "decoder_start_id"):
        value = getattr(config, name)
        if not isinstance(value, int) or not 0 <= value < config.vocab_size:
            raise ValueError(f"{name} must be a token id in [0, {config.vocab_size}), "
                             f"got {value!r}")
    if config.output_bias_buffer and not config.output_bias:
        raise ValueError("output_bias_buffer keeps the output bias fixed: it needs output_bias")
    if config.tie_source_target and config.src_vocab_size != config.vocab_size:
        raise ValueError(
            f"tie_source_target needs src_vocab_size == vocab_size, got {config.src_vocab_size} "
            f"and {config.vocab_size}")

def _check_modern(config: TransformerConfig) -> None:
    _check_choice("norm", config.norm, NORMS)
    for name in ("n_kv_heads", "d_head"):
        value = getattr(config, name)
        if value is not None and not is_count(value):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if config.n_kv_heads is not None and config.n_heads % config.n_kv_heads:
        raise ValueError(f"n_kv_heads ({config.n_kv_heads}) must divide n_heads "
                         f"({config.n_heads}): each key/value head serves a group of "
                         f"n_heads / n_kv_heads queries")
    if config.n_kv_heads not in (None, config.n_heads) and config.attention == "linear":
        raise ValueError(f"n_kv_heads={config.n_kv_heads} needs a softmax kernel: linear attention "
                         f"keeps one state per query head")
    if not _is_positive(config.rope_theta):
        raise ValueError(f"rope_theta must be positive, got {config.rope_theta!r}")
    window, layers = config.sliding_window, config.sliding_window_layers
    if window is not None and not is_count(window):
        raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
    if window is not None and config.attention in ("sparse", "linear"):
        raise ValueError(f"sliding_window masks each query's keys, which attention="
                         f"{config.attention!r} does not take; use 'fused', 'reference' or "
                         f"'chunked' (sparse attention has a local window of its own: "
                         f"attention_pattern='local')")
    local = config.rope_local_theta
    if local is not None and (not _is_positive(local) or window is None
                              or config.positions != "rotary"):
        raise ValueError(f"rope_local_theta is the RoPE base of sliding layers: a positive "
                         f"number with positions='rotary' and a sliding_window, got "
                         f"{local!r} (positions={config.positions!r}, sliding_window={window!r})")
    for name in ("attention_softcap", "logit_softcap"):
        cap = getattr(config, name)
        if cap is not None and not _is_positive(cap):
            raise ValueError(f"{name} must be a positive number or None, got {cap!r}")
    if config.attention_softcap is not None and config.attention != "reference":
        raise ValueError(f"attention_softcap transforms every attention score, which only "
                         f"attention='reference' writes out; got attention="
                         f"{config.attention!r}")
    if not config.first_attention_norm and not config.norm_first:
        raise ValueError("first_attention_norm=False drops the norm before the first layer's "
                         "config-attention, which only pre-norm has: it needs norm_first=True")
    if config.sandwich_norm and not config.norm_first:
        raise ValueError("sandwich_norm adds a norm after each sub-layer of a pre-norm block: "
                         "it needs norm_first=True")
    if layers is not None:
        if window is None:
            raise ValueError("sliding_window_layers needs a sliding_window")
        if layers == []:
            raise ValueError("sliding_window_layers=[] names no layer, so the sliding_window "
                             "would apply nowhere: set sliding_window=None instead")
        n = max(config.n_encoder_layers, config.n_decoder_layers)
        if not isinstance(layers, list) or not all(is_count(i, zero=True) and i < n
                                                   for i in layers):
            raise ValueError(f"sliding_window_layers must be a list of layer indices in "
                             f"[0, {n}) (of the encoder or decoder), got {layers!r}")
    _check_rotary(config)

def _check_rotary(config: TransformerConfig) -> None:
    fraction = config.rotary_fraction
    if not (_is_positive(fraction) and fraction <= 1):
        raise ValueError(f"rotary_fraction is the share of each head that rotary positions "
                         f"turn: a number in (0, 1], got {fraction!r}")
    if fraction != 1 and config.positions != "rotary":
        raise ValueError(f"rotary_fraction={fraction!r} rotates part of each head: it needs "
                         f"positions='rotary', not {config.positions!r}")
    if config.positions == "rotary" and fraction != 1 and (not config.rotary_dim
                                                           or config.rotary_dim % 2):
        raise ValueError(f"rotary_fraction={fraction!r} of a head width of {config.head_dim} "
                         f"rotates {config.rotary_dim} dimensions; rotary positions turn pairs "
                         f"and need an even number above 0")
    check_rope_scaling(config.rope_scaling, config.rotary_dim if config.positions == "rotary"
                       else None)
    if config.rope_scaling is not None and config.positions != "rotary":
        raise ValueError(f"rope_scaling scales rotary positions; positions is "
                         f"{config.positions!r}")
    if config.positions == "rotary" and config.head_dim % 2 and fraction == 1:
        raise ValueError(f"rotary positions rotate pairs of dimensions and need an even head "
                         f"width, got {config.head_dim} (d_model / n_heads or d_head)")

def _check_t5(config: TransformerConfig) -> None:
    buckets, distance = config.relative_attention_buckets, config.relative_attention_max_distance
    for name, value in (("relative_attention_buckets", buckets),
                        ("relative_attention_max_distance", distance)):
        if not is_count(value, zero=True):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not buckets:
        if distance != _default(config, "relative_attention_max_distance"):
            raise ValueError(f"relative_attention_max_distance={distance} sizes a relative "
                             f"position bias, which relative_attention_buckets=0 turns off")
        return
    if buckets < 4 or distance <= buckets // 2:
        raise ValueError(f"relative_attention_buckets must be >= 4 and below "
                         f"2 * relative_attention_max_distance (half the buckets are exact "
                         f"distances, the rest log-spaced up to the maximum), got {buckets} and "
                         f"{distance}")
    if config.positions != "none":
        raise ValueError(f"a relative position bias (relative_attention_buckets={buckets}) "
                         f"replaces absolute positions: set positions='none', not "
                         f"{config.positions!r}")
    if config.attention not in ("fused", "reference"):
        raise ValueError(f"attention={config.attention!r} cannot add a relative position bias to "
                         f"its scores; use attention='fused' or 'reference' with "
                         f"relative_attention_buckets")

def _check_attention_scale(config: TransformerConfig) -> None:
    scale = config.attention_scale
    if scale is not None and not (_is_positive(scale) and math.isfinite(scale)):
        raise ValueError(f"attention_scale must be a positive number or None, got {scale!r}")
    if scale is not None and not config.scale_attention:
        raise ValueError(f"attention_scale={scale!r} and scale_attention=False both set the "
                         f"score scale; set attention_scale alone")
    if config.attention == "linear" and (scale is not None or not config.scale_attention):
        name = "scale_attention=False" if scale is None else f"attention_scale={scale!r}"
        raise ValueError(f"{name} means nothing to attention='linear' (its feature map has "
                         f"no softmax scale); leave the score scale at its default")


def _default(config: TransformerConfig, name: str) -> object:
    return type(config).__dataclass_fields__[name].default


# The type checks every check of a config or an option shares: a bool is not a number here (True
# would silently mean 1)
def is_count(value: object, *, zero: bool = False) -> bool:
    """An int (not a bool) above 0, or at least 0 with ``zero``."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (value >= 0 if zero else value > 0))


def is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    """A number (not a bool) above 0."""
    return is_number(value) and value > 0


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
