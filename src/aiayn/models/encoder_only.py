"""Encoder-only models (BERT-style): bare hidden states, sequence classification, masked LM.

All three are the paper's encoder stack; the heads differ. Layers = ``config.n_encoder_layers``.

Legend: B batch, T length, D model width, V vocabulary, C classes.
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.models.heads import ClassificationHead, MaskedLMHead, initialise, pool
from aiayn.nn.embedding import token_embedding
from aiayn.nn.stacks import AttentionMaps, Encoder


class TransformerEncoder(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, D).

    Example:
        >>> import torch
        >>> from aiayn import TransformerConfig, TransformerEncoder
        >>> encoder = TransformerEncoder(TransformerConfig.preset("tiny"))
        >>> ids = torch.randint(3, 100, (4, 16))
        >>> encoder(ids, padding_mask=ids != 0).shape  # (B, T, D)
        torch.Size([4, 16, 32])
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config, token_embedding(config, config.vocab_size))
        initialise(self, config)

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.encoder.embeddings.tokens

    def forward(self, ids: Tensor, *, padding_mask: Tensor | None = None,
                token_types: Tensor | None = None, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """``padding_mask`` (B, T), True = real token; ``token_types`` (B, T) segment ids."""
        hidden, weights = self.encoder(ids, padding_mask, token_types=token_types,
                                       need_weights=return_attention)
        return (hidden, AttentionMaps(encoder=weights)) if return_attention else hidden


class _EncoderWithHead(nn.Module):
    """An encoder followed by a head; subclasses define ``head_output(hidden, padding_mask)``."""

    encoder: TransformerEncoder

    def head_output(self, hidden: Tensor, padding_mask: Tensor | None) -> Tensor:
        raise NotImplementedError

    def hidden_states(self, ids: Tensor, *, padding_mask: Tensor | None = None,
                      token_types: Tensor | None = None) -> Tensor:
        """Final encoder states (B, T, D) before the head."""
        return self.encoder.encoder(ids, padding_mask, token_types=token_types)[0]

    def forward(self, ids: Tensor, *, padding_mask: Tensor | None = None,
                token_types: Tensor | None = None, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """``padding_mask`` (B, T), True = real token; ``token_types`` (B, T) segment ids."""
        hidden, weights = self.encoder.encoder(ids, padding_mask, token_types=token_types,
                                               need_weights=return_attention)
        out = self.head_output(hidden, padding_mask)
        return (out, AttentionMaps(encoder=weights)) if return_attention else out


class SequenceClassifier(_EncoderWithHead):
    """Class logits (B, C): encoder, pooling (``config.pooling``: first token or mean), head."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = TransformerEncoder(config)
        self.head = ClassificationHead(config)
        initialise(self.head, config)

    def head_output(self, hidden: Tensor, padding_mask: Tensor | None) -> Tensor:
        return self.head(pool(hidden, padding_mask, self.config.pooling))  # (B, C)


class MaskedLM(_EncoderWithHead):
    """Vocabulary logits (B, T, V) at every position, for masked-token prediction (BERT)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = TransformerEncoder(config)
        self.head = MaskedLMHead(config, self.encoder.token_embedding)
        initialise(self.head, config)  # the tied matrix is not a module of the head: untouched

    def head_output(self, hidden: Tensor, padding_mask: Tensor | None) -> Tensor:
        return self.head(hidden)  # (B, T, V)
