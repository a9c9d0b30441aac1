"""Output heads and weight initialisation shared by the model families.

Legend: B batch, T length, D model width, V vocabulary, C classes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.nn.attention.multihead import CrossAttention, SelfAttention
from aiayn.nn.feedforward import activation_function
from aiayn.nn.layers import DecoderLayer, EncoderLayer
from aiayn.nn.norms import layer_norm


class OutputProjection(nn.Module):
    """Hidden states (B, T, D) -> logits (B, T, V); "the pre-softmax linear transformation" (3.4).

    With ``tied`` the weight is the given embedding matrix itself (paper 3.4), not a copy. With
    ``config.scale_output`` the hidden states are first multiplied by ``scale`` = D^-0.5 (T5, whose
    tied matrix is trained at unit scale; mesh-tensorflow's ``logits / sqrt(d_model)``). With
    ``config.logit_softcap`` = c each logit x becomes c * tanh(x / c) (Gemma 2).
    """

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding, *, tied: bool):
        super().__init__()
        vocab_size, d_model = embedding.weight.shape
        self.tied = tied
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
            nn.init.xavier_uniform_(self.weight)
        if config.output_bias and config.output_bias_buffer:  # fixed: loaded, never trained
            self.register_buffer("bias", torch.zeros(vocab_size))
        else:
            self.bias = nn.Parameter(torch.zeros(vocab_size)) if config.output_bias else None
        self.scale = d_model ** -0.5 if config.scale_output else 1.0
        self.softcap = config.logit_softcap

    def forward(self, hidden: Tensor) -> Tensor:
        if self.scale != 1.0:
            hidden = hidden * self.scale
        logits = nn.functional.linear(hidden, self.weight, self.bias)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def pool(hidden: Tensor, padding_mask: Tensor | None, how: str) -> Tensor:
    """(B, T, D) -> (B, D): the first token, or the mean over real tokens."""
    if how == "first":
        return hidden[:, 0]
    if padding_mask is None:
        return hidden.mean(dim=1)
    weights = padding_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


POOLER_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU,
                      "gelu_tanh": lambda: nn.GELU(approximate="tanh")}


class ClassificationHead(nn.Module):
    """Pooled (B, D) -> class logits (B, C), with an optional dense "pooler", its activation and a
    norm: BERT's dense + tanh, DistilBERT's ``pre_classifier`` + ReLU (``config.pooler_activation``),
    ModernBERT's dense + GELU + LayerNorm (``config.pooler_norm``; the MLM transform's shape)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.logit_softcap is not None:
            raise ValueError(f"logit_softcap={config.logit_softcap!r} caps a language model's "
                             f"vocabulary logits; a classification head's class logits take none")
        self.pooler = (nn.Linear(config.d_model, config.d_model, bias=config.head_bias)
                       if config.pooler else None)
        self.activation = POOLER_ACTIVATIONS[config.pooler_activation]()
        self.norm = layer_norm(config) if config.pooler and config.pooler_norm else None
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)

    def forward(self, pooled: Tensor) -> Tensor:
        if self.pooler is not None:
            pooled = self.activation(self.pooler(pooled))  # (B, D)
        if self.norm is not None:
            pooled = self.norm(pooled)
        return self.classifier(self.dropout(pooled))


class MaskedLMHead(nn.Module):
    """Hidden states (B, T, D) -> vocabulary logits (B, T, V) for masked-token prediction (BERT)."""

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding):
        super().__init__()
        if config.mlm_transform:
            self.dense = nn.Linear(config.d_model, config.d_model, bias=config.head_bias)
            self.activation = activation_function(config.activation)
            self.norm = layer_norm(config)
        else:
            self.dense = None
        self.projection = OutputProjection(config, embedding, tied=config.tie_output)

    def forward(self, hidden: Tensor) -> Tensor:
        if self.dense is not None:
            hidden = self.norm(self.activation(self.dense(hidden)))
        return self.projection(hidden)


def _embedding_std(config: TransformerConfig) -> float:
    if config.init_std is not None:
        return config.init_std
    return 1.0 if config.scale_output else config.d_model ** -0.5


def unit_scale_prefixes(config: TransformerConfig) -> tuple[str, ...]:
    """Parameter-name prefixes, in an encoder-decoder ``Transformer``, of the weights ``initialise``
    starts at N(0, 1): every embedding table (tokens, T5's relative-position tables) and an untied
    output matrix, when ``scale_output`` is set without ``init_std`` (T5); () otherwise.

    T5 trains them with Adafactor, whose step follows each weight's size; Adam's does not, so from
    scratch they need a larger learning rate (``TrainingConfig.lr_scales``; docs/t5.md).
    """
    if not config.scale_output or config.init_std is not None:
        return ()
    return ("encoder.embeddings.", "decoder.embeddings.", "encoder.position_bias.",
            "decoder.position_bias.", "generator.")


def initialise(model: nn.Module, config: TransformerConfig) -> None:
    """Initial weights. The paper gives none; we follow its reference code (tensor2tensor):
    Xavier-uniform matrices and N(0, D^-1/2) embeddings, which the sqrt(D) scaling brings to unit size.
    With ``config.init_std`` every matrix and embedding is N(0, init_std) instead (GPT-2, BERT).
    Without ``scale_attention`` the queries' matrices start Dh^-1/2 smaller: the 1/sqrt(d_k) of eq. 1
    folded into the initialisation, as T5 (mesh-tensorflow) does; with ``scale_output`` the
    embeddings (and an untied output matrix) start at unit scale, the size T5's D^-1/2 output
    rescaling is made for (without it the first logits are sqrt(D) times too small to learn from).
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if config.init_std is None:
                nn.init.xavier_uniform_(module.weight)
            else:
                nn.init.normal_(module.weight, std=config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=_embedding_std(config))
        elif isinstance(module, OutputProjection) and not module.tied and config.scale_output:
            nn.init.normal_(module.weight, std=_embedding_std(config))
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm) and module.weight is not None:
            nn.init.ones_(module.weight)
    if not config.scale_attention:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, SelfAttention) and module.fused_projections:
                    module.qkv_proj.weight[:module.split_sizes[0]] *= module.head_dim ** -0.5
                elif isinstance(module, (SelfAttention, CrossAttention)):
                    module.q_proj.weight *= module.head_dim ** -0.5
    if config.scaled_residual_init:  # config_checks: init_std is set
        # GPT-2 (Radford et al. 2019, 2.3): the layers' projections into the residual stream, the
        # attention output and the FFN's last matrix, start at std / sqrt(2 * layers) so the sum
        # of 2 * layers residual branches keeps the size of one. The layers the model has: a
        # decoder-only model's config may also count encoder layers it does not build.
        layers = max(sum(isinstance(m, (EncoderLayer, DecoderLayer)) for m in model.modules()), 1)
        std = config.init_std / (2 * layers) ** 0.5
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(("out_proj", "linear2", "down_proj")):
                nn.init.normal_(module.weight, std=std)
