"""Model configuration: one typed dataclass, validated on construction (``aiayn.config_checks``);
named presets in ``aiayn.presets`` (``PRESETS``, also importable from here).

Every architectural choice that differs between the paper, BERT, GPT-2 and Marian/BART is a field here,
so the model code never branches on "which model is this" and the interop loaders only fill in fields.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiayn.config_checks import validate
from aiayn.presets import PRESETS

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
PositionKind = Literal["sinusoidal", "learned", "rotary", "none"]
SinusoidLayout = Literal["interleaved", "split", "fairseq"]
Pooling = Literal["first", "mean"]
PoolerActivation = Literal["tanh", "relu", "gelu", "gelu_tanh", "silu"]
Norm = Literal["layer", "rms"]
SparsePattern = Literal["local", "strided", "local+strided"]

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
    # the output bias a fixed buffer, never trained (transformers' final_logits_bias: Marian, BART)
    output_bias_buffer: bool = False
    # lookups of pad_id add no gradient to its embedding row (nn.Embedding's padding_idx), as in
    # transformers' BART, Marian, mBART, M2M100 and Llama-style models: it matters where pad_id is
    # also a real input (Marian's decoder start, a pad that is the end-of-text token)
    embedding_padding_idx: bool = False
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
        validate(self)

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


def count_parameters(module: Any) -> int:
    """Trainable parameters; a tied matrix counts once, as the paper counts it."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
