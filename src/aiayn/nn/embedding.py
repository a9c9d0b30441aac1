"""Input embeddings (paper 3.4): token embedding * sqrt(d_model) + position, then dropout (5.4).

The token matrix is an ``nn.Embedding`` passed in, so the source embedding, the target embedding and the
output projection can share one matrix (paper 3.4) by handing the same object to several places.

Legend: B batch, T length, D model width, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.nn.norms import layer_norm
from aiayn.nn.positions import LearnedPositions, SinusoidalPositions


def token_embedding(config: TransformerConfig, vocab_size: int) -> nn.Embedding:
    """The token table (V, D); with ``config.embedding_padding_idx`` lookups of ``pad_id`` add no
    gradient to its row (``nn.Embedding``'s ``padding_idx``, as transformers' BART and Llama)."""
    return nn.Embedding(vocab_size, config.d_model,
                        padding_idx=config.pad_id if config.embedding_padding_idx else None)


def make_positions(config: TransformerConfig) -> nn.Module | None:
    """The added position vectors; None for "none" and for "rotary" (applied inside attention)."""
    if config.positions == "sinusoidal":
        return SinusoidalPositions(config.max_length, config.d_model, config.sinusoid_layout,
                                   config.position_offset)
    if config.positions == "learned":
        return LearnedPositions(config.max_length, config.d_model, config.position_offset)
    return None


class Embeddings(nn.Module):
    """Token ids (B, T) -> input vectors (B, T, D)."""

    def __init__(self, config: TransformerConfig, tokens: nn.Embedding):
        super().__init__()
        self.tokens = tokens
        self.scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
        self.positions = make_positions(config)
        self.position_limit = config.position_limit  # None: any length (T5, DeBERTa-v3)
        self.token_types = (nn.Embedding(config.type_vocab_size, config.d_model)
                            if config.type_vocab_size else None)
        self.norm = layer_norm(config) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.dropout)

    def real_positions(self, padding_mask: Tensor) -> Tensor:
        """(B, S) positions that count only real tokens (``positions_skip_padding``): the number of
        real tokens before each one; a pad reads the row before position 0 (RoBERTa's padding
        row) where the table is offset, else position 0. Rows longer than the table are counted
        (one device read; not under ``torch.compile``)."""
        limit = self.position_limit
        if limit is not None and padding_mask.shape[1] > limit \
                and not torch.compiler.is_compiling():
            longest = int(padding_mask.sum(1).max())
            if longest > limit:
                raise ValueError(f"sequence of {longest} positions exceeds the position table "
                                 f"(max_length={limit})")
        pad_position = -1 if self.positions.offset > 0 else 0
        return (padding_mask.cumsum(1) - 1).masked_fill(~padding_mask, pad_position)

    def forward(self, ids: Tensor, *, start: int = 0, positions: Tensor | None = None,
                token_types: Tensor | None = None) -> Tensor:
        """Embed ``ids`` (B, T) that sit at positions ``start ..`` (or at explicit ``positions``).

        Raises:
            ValueError: an id or a token type outside its table (on CPU; CUDA asserts on the
                device instead), or ``token_types`` for a model without segment embeddings.
        """
        try:  # a range check up front would cost every decoding step a reduction
            x = self.tokens(ids)  # (B, T, D)
        except IndexError:
            vocab = self.tokens.num_embeddings
            raise ValueError(f"token ids must lie in [0, vocab_size={vocab}), got ids from "
                             f"{int(ids.min())} to {int(ids.max())}") from None
        if self.scale != 1.0:
            x = x * self.scale
        if self.positions is not None:
            x = x + self.positions(ids.shape[1], start, positions)  # (T, D) or (B, T, D)
        elif self.position_limit is not None and start + ids.shape[1] > self.position_limit:
            raise ValueError(f"sequence of {start + ids.shape[1]} positions exceeds "
                             f"max_length={self.position_limit}")
        if token_types is not None and self.token_types is None:
            raise ValueError("token_types given, but the model has no segment embeddings "
                             "(type_vocab_size=0)")
        if self.token_types is not None:
            # All-zero segments (the default) need no lookup: add row 0 directly.
            if token_types is None:
                x = x + self.token_types.weight[0]
            else:
                try:
                    x = x + self.token_types(token_types)
                except IndexError:
                    types = self.token_types.num_embeddings
                    raise ValueError(f"token_types must lie in [0, type_vocab_size={types}), got "
                                     f"{int(token_types.min())} to {int(token_types.max())}"
                                     ) from None
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)
