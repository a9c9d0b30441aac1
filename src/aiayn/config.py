"""Model configuration: one typed dataclass, validated on construction; named presets in
``aiayn.presets`` (``PRESETS``, also importable from here).

Every architectural choice that differs between the paper, BERT, GPT-2 and Marian/BART is a field here,
so the model code never branches on "which model is this" and the interop loaders only fill in fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiayn.presets import PRESETS

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
PositionKind = Literal["sinusoidal", "learned", "rotary", "none"]
SinusoidLayout = Literal["interleaved", "split", "fairseq"]
Pooling = Literal["first", "mean"]
PoolerActivation = Literal["tanh", "relu", "gelu", "gelu_tanh", "silu"]
Norm = Literal["layer", "rms"]
SparsePattern = Literal["local", "strided", "local+strided"]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
POSITION_KINDS = ("sinusoidal", "learned", "rotary", "none")
NORMS = ("layer", "rms")
SINUSOID_LAYOUTS = ("interleaved", "split", "fairseq")
POOLINGS = ("first", "mean")
POOLER_ACTIVATIONS = ("tanh", *ACTIVATIONS)
SPARSE_PATTERNS = ("local", "strided", "local+strided")


@dataclass(kw_only=True)
class TransformerConfig:
    """Hyper-parameters of every aiayn model family (paper Table 3 names in brackets).

    Fields that a family does not use are ignored by it (an encoder-only model has no decoder layers).
    """

    # --- sizes -------------------------------------------------------------------------------------
    vocab_size: int = 37000  # shared source/target vocabulary (paper 5.1: ~37000 BPE tokens)
    src_vocab_size: int | None = None  # None: same as vocab_size (needed when source is not tied)
    d_model: int = 512  # [d_model]
    n_heads: int = 8  # [h]
    d_ff: int = 2048  # [d_ff]
    n_encoder_layers: int = 6  # [N]
    n_decoder_layers: int = 6  # [N]
    max_length: int = 1024  # size of the position table; longer inputs are an error (not with
    # disentangled_attention and positions "none": DeBERTa-v3 reads relative distances only)

    # --- regularisation (paper 5.4) ----------------------------------------------------------------
    dropout: float = 0.1  # [P_drop]: residual and embedding dropout
    attention_dropout: float = 0.0  # on the attention weights
    activation_dropout: float = 0.0  # inside the FFN, after the non-linearity

    # --- block details -----------------------------------------------------------------------------
    activation: Activation = "relu"  # paper 3.3: ReLU
    norm_first: bool = False  # False: the paper's post-norm; True: pre-norm (GPT-2)
    final_norm: bool | None = None  # LayerNorm after the last layer; None: same as norm_first
    # False: each stack's first layer reads its self-attention input un-normalised (pre-norm only;
    # ModernBERT, whose embedding LayerNorm already normalises it)
    first_attention_norm: bool = True
    layer_norm_eps: float = 1e-5
    layer_norm_bias: bool = True  # False: LayerNorm with a gain only (nanoGPT with bias=False)
    bias: bool = True  # biases in the attention and FFN projections
    qkv_bias: bool | None = None  # biases on the q, k, v projections only; None: bias (Qwen2: True)
    fused_projections: bool = True  # one (D, 3D) matmul for q, k, v instead of three (D, D)
    attention: str = "fused"  # attention kernel name, see aiayn.nn.attention.kernels.make_kernel
    # options of the efficient kernels (docs/efficient-attention.md); other kernels ignore them
    attention_window: int = 128  # sparse: local window (Child et al. 2019)
    attention_stride: int = 128  # sparse: stride of the strided pattern
    # sparse: strided keys at most this many strides away (back, and forward when bidirectional);
    # None: all of them (Child et al. 2019, O(n^2 / stride)); a number makes the strided pattern a
    # dilated sliding window (Beltagy et al. 2020, Longformer) whose cost is linear in n
    attention_stride_count: int | None = None
    attention_pattern: SparsePattern = "local+strided"  # sparse: 'local', 'strided', 'local+strided'
    attention_chunk_size: int = 256  # chunked: query/key tile; linear: causal chunk

    # --- embeddings and positions ------------------------------------------------------------------
    positions: PositionKind = "sinusoidal"  # paper 3.5; "rotary": RoPE on q and k (see below)
    # paper: sin on even dims; "split": sin | cos halves; "fairseq": halves, tensor2tensor's frequencies
    sinusoid_layout: SinusoidLayout = "interleaved"
    # position tables indexed from this offset (BART keeps 2 spare rows; M2M100 counts from pad + 1)
    position_offset: int = 0
    # an encoder input's position counts only the real tokens before it (from the padding mask), so
    # left padding shifts nothing: RoBERTa, XLM-R and M2M100 / NLLB number positions this way
    positions_skip_padding: bool = False
    scale_embeddings: bool = True  # paper 3.4: multiply embeddings by sqrt(d_model)
    embedding_norm: bool = False  # LayerNorm after embedding + position (BERT, BART)
    type_vocab_size: int = 0  # segment embeddings (BERT); 0 = none
    tie_source_target: bool = True  # paper 3.4: source and target share one embedding matrix
    tie_output: bool = True  # paper 3.4: the pre-softmax projection shares the target embedding
    output_bias: bool = False  # a bias on the output logits (BERT MLM, Marian's final_logits_bias)
    init_std: float | None = None  # None: Xavier matrices, N(0, 1/sqrt(D)) embeddings; else N(0, std)
    scaled_residual_init: bool = False  # GPT-2: std / sqrt(2 * layers) for projections into the residual

    # --- the modern decoder (docs/modern-decoder.md): Llama, Mistral, Qwen ------------------------
    norm: Norm = "layer"  # "rms": RMSNorm, no mean and no bias (Zhang & Sennrich 2019; T5, Llama)
    gated_ffn: bool = False  # down(act(gate(x)) * up(x)) (Shazeer 2020); silu: SwiGLU, gelu: GEGLU
    n_kv_heads: int | None = None  # key/value heads; None: n_heads; 1: multi-query; else grouped
    d_head: int | None = None  # [d_k = d_v]; None: d_model / n_heads (paper 3.2.2)
    rope_theta: float = 10000.0  # base of the rotary frequencies (Su et al. 2021), positions="rotary"
    # scaled RoPE for contexts beyond the pretraining length, with the keys of Hugging Face's
    # rope_parameters, e.g. {"rope_type": "llama3", "factor": 32.0, ...} (aiayn.nn.rotary); None: plain
    rope_scaling: dict[str, Any] | None = None
    # RoPE turns only the first int(Dh * fraction) dims of each head (HF's partial_rotary_factor;
    # Phi-4-mini: 0.75); the rest pass through unrotated
    rotary_fraction: float = 1.0
    qk_norm: bool = False  # the config's norm over Dh on every head's q and k, before RoPE (Qwen3)
    # self-attention sees only keys less than W positions away (itself included): the last W in the
    # decoder (Mistral, Qwen, Gemma), the W - 1 on either side in the encoder (ModernBERT)
    sliding_window: int | None = None
    sliding_window_layers: list[int] | None = None  # the layers that slide (of each stack); None: all
    rope_local_theta: float | None = None  # sliding layers' RoPE base, never scaled (Gemma 3: 1e4)
    sandwich_norm: bool = False  # pre-norm plus a norm on each sub-layer's output (Gemma 2, 3)
    # Soft-capping (Gemma 2): scores or logits x -> c * tanh(x / c), bounded by c; None: off
    attention_softcap: float | None = None  # each attention score, before the mask
    logit_softcap: float | None = None  # each output logit

    # --- T5 (docs/t5.md; Raffel et al. 2020) -------------------------------------------------------
    # relative position bias: buckets of log distance, one learned scalar per bucket and head added
    # to the attention scores; 0 = none (T5: 32 buckets up to distance 128)
    relative_attention_buckets: int = 0
    relative_attention_max_distance: int = 128
    scale_attention: bool = True  # divide q.k by sqrt(d_k) (paper 3.2.1); T5 folds it into the init
    attention_scale: float | None = None  # q.k times this, not 1/sqrt(d_k) (Gemma 2 27B: 144^-1/2)
    scale_output: bool = False  # multiply the hidden states by d_model^-0.5 before the output projection
    # DeBERTa's disentangled attention (He et al. 2021; aiayn.nn.disentangled): a dict of terms
    # (["c2p", "p2c"]), span, max_distance, share_projections, norm; None: off
    disentangled_attention: dict[str, Any] | None = None

    # --- heads of the encoder-only family ----------------------------------------------------------
    num_labels: int = 2
    pooling: Pooling = "first"  # "first": the first ([CLS]) token; "mean": mean over real tokens
    pooler: bool = False  # a dense layer + pooler_activation on the pooled vector (BERT's pooler)
    pooler_activation: PoolerActivation = "tanh"  # BERT's tanh; DistilBERT's pre_classifier: relu
    pooler_norm: bool = False  # with pooler: the norm after its activation (ModernBERT's head)
    head_bias: bool = True  # biases on the pooler and the MLM transform's dense layers
    mlm_transform: bool = True  # BERT's dense + activation + LayerNorm before the MLM projection

    # --- images: the Vision Transformer (Dosovitskiy et al. 2021); text models ignore these -------
    image_size: int = 224  # height = width of the input images in pixels (ViT-Base: 224)
    patch_size: int = 16  # P: images are cut into (image_size / P)^2 non-overlapping P x P patches
    num_channels: int = 3  # C: channels of the input images (3 RGB, 1 grey)

    # --- special tokens ----------------------------------------------------------------------------
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    decoder_start_id: int | None = None  # first decoder input; None: bos_id (Marian uses pad_id)

    def __post_init__(self) -> None:
        if self.src_vocab_size is None:
            self.src_vocab_size = self.vocab_size
        if self.final_norm is None:
            self.final_norm = self.norm_first
        if self.decoder_start_id is None:
            self.decoder_start_id = self.bos_id
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "src_vocab_size", "d_model", "n_heads", "d_ff", "max_length",
                     "num_labels", "attention_window", "attention_stride", "attention_chunk_size",
                     "image_size", "patch_size", "num_channels"):
            value = getattr(self, name)
            if not _is_count(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        count = self.attention_stride_count
        if count is not None and not _is_count(count):
            raise ValueError(f"attention_stride_count must be a positive integer or None, got {count!r}")
        for name in ("n_encoder_layers", "n_decoder_layers", "type_vocab_size", "position_offset"):
            value = getattr(self, name)
            if not _is_count(value, zero=True):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size ({self.patch_size}) must divide image_size "
                             f"({self.image_size}): the ViT cuts images into whole patches")
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}), or set "
                f"d_head")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if self.init_std is not None and not (isinstance(self.init_std, (int, float))
                                              and self.init_std > 0):
            raise ValueError(f"init_std must be positive or None, got {self.init_std!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("positions", self.positions, POSITION_KINDS)
        if self.positions_skip_padding and self.positions not in ("learned", "sinusoidal"):
            raise ValueError(f"positions_skip_padding numbers the rows of a position table; "
                             f"positions={self.positions!r} has none")
        _check_choice("sinusoid_layout", self.sinusoid_layout, SINUSOID_LAYOUTS)
        _check_choice("pooling", self.pooling, POOLINGS)
        _check_choice("pooler_activation", self.pooler_activation, POOLER_ACTIVATIONS)
        from aiayn.nn.attention.kernels import KERNELS  # late: kernels import nothing from here

        _check_choice("attention", self.attention, tuple(KERNELS))
        _check_choice("attention_pattern", self.attention_pattern, SPARSE_PATTERNS)
        if self.attention in ("linear", "chunked") and self.attention_dropout > 0:
            raise ValueError(f"attention_dropout must be 0 with attention={self.attention!r} (it never "
                             f"forms the attention weights), got {self.attention_dropout!r}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        self._validate_modern()
        self._validate_t5()
        self._validate_attention_scale()
        from aiayn.nn.disentangled import disentangled_spec  # late: it imports nothing from here

        disentangled_spec(self)
        for name in ("pad_id", "bos_id", "eos_id", "decoder_start_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        if self.tie_source_target and self.src_vocab_size != self.vocab_size:
            raise ValueError(
                f"tie_source_target needs src_vocab_size == vocab_size, got {self.src_vocab_size} "
                f"and {self.vocab_size}")

    def _validate_modern(self) -> None:
        _check_choice("norm", self.norm, NORMS)
        for name in ("n_kv_heads", "d_head"):
            value = getattr(self, name)
            if value is not None and not _is_count(value):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}): "
                             f"each key/value head serves a group of n_heads / n_kv_heads queries")
        if self.n_kv_heads not in (None, self.n_heads) and self.attention == "linear":
            raise ValueError(f"n_kv_heads={self.n_kv_heads} needs a softmax kernel: linear attention "
                             f"keeps one state per query head")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta!r}")
        window, layers = self.sliding_window, self.sliding_window_layers
        if window is not None and not _is_count(window):
            raise ValueError(f"sliding_window must be a positive integer or None, got {window!r}")
        if window is not None and self.attention in ("sparse", "linear"):
            raise ValueError(f"sliding_window masks each query's keys, which attention="
                             f"{self.attention!r} does not take; use 'fused', 'reference' or "
                             f"'chunked' (sparse attention has a local window of its own: "
                             f"attention_pattern='local')")
        local = self.rope_local_theta
        if local is not None and (not _is_positive(local) or window is None
                                  or self.positions != "rotary"):
            raise ValueError(f"rope_local_theta is the RoPE base of sliding layers: a positive "
                             f"number with positions='rotary' and a sliding_window, got "
                             f"{local!r} (positions={self.positions!r}, sliding_window={window!r})")
        for name in ("attention_softcap", "logit_softcap"):
            cap = getattr(self, name)
            if cap is not None and not _is_positive(cap):
                raise ValueError(f"{name} must be a positive number or None, got {cap!r}")
        if self.attention_softcap is not None and self.attention != "reference":
            raise ValueError(f"attention_softcap transforms every attention score, which only "
                             f"attention='reference' writes out; got attention="
                             f"{self.attention!r}")
        if not self.first_attention_norm and not self.norm_first:
            raise ValueError("first_attention_norm=False drops the norm before the first layer's "
                             "self-attention, which only pre-norm has: it needs norm_first=True")
        if self.sandwich_norm and not self.norm_first:
            raise ValueError("sandwich_norm adds a norm after each sub-layer of a pre-norm block: "
                             "it needs norm_first=True")
        if layers is not None:
            if window is None:
                raise ValueError("sliding_window_layers needs a sliding_window")
            n = max(self.n_encoder_layers, self.n_decoder_layers)
            if not isinstance(layers, list) or not all(_is_count(i, zero=True) and i < n
                                                       for i in layers):
                raise ValueError(f"sliding_window_layers must be a list of layer indices in "
                                 f"[0, {n}) (of the encoder or decoder), got {layers!r}")
        self._validate_rotary()

    def _validate_rotary(self) -> None:
        from aiayn.nn.rotary import check_rope_scaling  # late: rotary imports nothing from here

        fraction = self.rotary_fraction
        if not (_is_positive(fraction) and fraction <= 1):
            raise ValueError(f"rotary_fraction is the share of each head that rotary positions "
                             f"turn: a number in (0, 1], got {fraction!r}")
        if fraction != 1 and self.positions != "rotary":
            raise ValueError(f"rotary_fraction={fraction!r} rotates part of each head: it needs "
                             f"positions='rotary', not {self.positions!r}")
        if self.positions == "rotary" and fraction != 1 and (not self.rotary_dim
                                                             or self.rotary_dim % 2):
            raise ValueError(f"rotary_fraction={fraction!r} of a head width of {self.head_dim} "
                             f"rotates {self.rotary_dim} dimensions; rotary positions turn pairs "
                             f"and need an even number above 0")
        check_rope_scaling(self.rope_scaling, self.rotary_dim if self.positions == "rotary"
                           else None)
        if self.rope_scaling is not None and self.positions != "rotary":
            raise ValueError(f"rope_scaling scales rotary positions; positions is "
                             f"{self.positions!r}")
        if self.positions == "rotary" and self.head_dim % 2 and fraction == 1:
            raise ValueError(f"rotary positions rotate pairs of dimensions and need an even head "
                             f"width, got {self.head_dim} (d_model / n_heads or d_head)")

    def _validate_t5(self) -> None:
        buckets, distance = self.relative_attention_buckets, self.relative_attention_max_distance
        for name, value in (("relative_attention_buckets", buckets),
                            ("relative_attention_max_distance", distance)):
            if not _is_count(value, zero=True):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not buckets:
            return
        if buckets < 4 or distance <= buckets // 2:
            raise ValueError(f"relative_attention_buckets must be >= 4 and below "
                             f"2 * relative_attention_max_distance (half the buckets are exact "
                             f"distances, the rest log-spaced up to the maximum), got {buckets} and "
                             f"{distance}")
        if self.positions != "none":
            raise ValueError(f"a relative position bias (relative_attention_buckets={buckets}) "
                             f"replaces absolute positions: set positions='none', not "
                             f"{self.positions!r}")
        if self.attention not in ("fused", "reference"):
            raise ValueError(f"attention={self.attention!r} cannot add a relative position bias to "
                             f"its scores; use attention='fused' or 'reference' with "
                             f"relative_attention_buckets")

    def _validate_attention_scale(self) -> None:
        scale = self.attention_scale
        if scale is not None and not (_is_positive(scale) and math.isfinite(scale)):
            raise ValueError(f"attention_scale must be a positive number or None, got {scale!r}")
        if scale is not None and not self.scale_attention:
            raise ValueError(f"attention_scale={scale!r} and scale_attention=False both set the "
                             f"score scale; set attention_scale alone")
        if self.attention == "linear" and (scale is not None or not self.scale_attention):
            name = "scale_attention=False" if scale is None else f"attention_scale={scale!r}"
            raise ValueError(f"{name} means nothing to attention='linear' (its feature map has "
                             f"no softmax scale); leave the score scale at its default")

    @property
    def head_dim(self) -> int:
        """Width of one attention head, d_k = d_v = d_model / h (paper 3.2.2), or ``d_head``."""
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Dr, the dimensions of each head that rotary positions turn: int(Dh * rotary_fraction),
        as transformers rounds it."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def position_limit(self) -> int | None:
        """The most positions a sequence may hold: ``max_length``, or None (any length) without an
        absolute table or rotary positions, where T5's relative bias or DeBERTa's disentangled
        attention reads only bucketed or clamped distances (as in transformers)."""
        relative = self.relative_attention_buckets or self.disentangled_attention is not None
        return None if self.positions == "none" and relative else self.max_length

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or one per query head (the paper)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    # --- presets and serialisation -----------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "TransformerConfig":
        """The named preset (see ``PRESETS``), with any field overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> "TransformerConfig":
        """A copy with some fields changed, validated again.

        A derived field that still holds its derived value follows its source: changing
        ``vocab_size`` also changes an untouched ``src_vocab_size`` (and likewise ``norm_first`` ->
        ``final_norm``, ``bos_id`` -> ``decoder_start_id``).
        """
        for derived, source in _DERIVED_FIELDS:
            if source in changes and derived not in changes \
                    and getattr(self, derived) == getattr(self, source):
                changes[derived] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransformerConfig":
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "TransformerConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"config file not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not a valid JSON config ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a config must be a JSON object")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None


# (derived field, the field it defaults to): __post_init__ fills a None derived field from its source.
_DERIVED_FIELDS = (("src_vocab_size", "vocab_size"), ("final_norm", "norm_first"),
                   ("decoder_start_id", "bos_id"))


def _is_count(value: object, *, zero: bool = False) -> bool:
    """An int (not a bool) above 0, or at least 0 with ``zero``."""
    return (isinstance(value, int) and not isinstance(value, bool)
            and (value >= 0 if zero else value > 0))


def _is_positive(value: object) -> bool:
    """A number (not a bool) above 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def count_parameters(module: Any) -> int:
    """Trainable parameters; a tied matrix counts once, as the paper counts it."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
