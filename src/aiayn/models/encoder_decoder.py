"""The paper's model (Figure 1): encoder stack, decoder stack, shared embeddings, output projection.

Legend: B batch, S source length, T target length, D model width, V vocabulary.
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.nn.attention.cache import DecoderCache
from aiayn.config import TransformerConfig
from aiayn.models.heads import OutputProjection, initialise
from aiayn.nn.embedding import token_embedding
from aiayn.nn.stacks import AttentionMaps, Decoder, Encoder


class Transformer(nn.Module):
    """Encoder-decoder Transformer returning target logits.

    Example:
        >>> import torch
        >>> from aiayn import Transformer, TransformerConfig
        >>> model = Transformer(TransformerConfig.preset("tiny"))
        >>> src, tgt = torch.randint(3, 100, (2, 9)), torch.randint(3, 100, (2, 7))
        >>> model(src, tgt, src_padding_mask=src != 0).shape  # (B, T, V)
        torch.Size([2, 7, 100])
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        target_tokens = token_embedding(config, config.vocab_size)
        source_tokens = (target_tokens if config.tie_source_target
                         else token_embedding(config, config.src_vocab_size))
        self.encoder = Encoder(config, source_tokens)
        self.decoder = Decoder(config, target_tokens, cross_attention=True)
        self.generator = OutputProjection(config, target_tokens, tied=config.tie_output)
        initialise(self, config)

    def encode(self, src: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        """Source ids (B, S) -> memory (B, S, D)."""
        return self.encoder(src, src_padding_mask)[0]

    def decode(self, tgt: Tensor, memory: Tensor | None, *,
               memory_padding_mask: Tensor | None = None, tgt_padding_mask: Tensor | None = None,
               cache: DecoderCache | None = None) -> Tensor:
        """Target ids (B, T) and memory (B, S, D) -> logits (B, T, V); see ``Decoder.forward``."""
        hidden = self.decoder(tgt, memory, padding_mask=tgt_padding_mask,
                              memory_padding_mask=memory_padding_mask, cache=cache)[0]
        return self.generator(hidden)

    def hidden_states(self, src: Tensor, tgt: Tensor, *, src_padding_mask: Tensor | None = None,
                      tgt_padding_mask: Tensor | None = None) -> Tensor:
        """Teacher-forced final decoder states (B, T, D) before the output projection."""
        memory = self.encoder(src, src_padding_mask)[0]  # (B, S, D)
        return self.decoder(tgt, memory, padding_mask=tgt_padding_mask,
                            memory_padding_mask=src_padding_mask)[0]

    def new_cache(self, batch: int, max_length: int | None = None, **kwargs) -> DecoderCache:
        """A static decoder cache for incremental decoding of ``batch`` sequences."""
        return self.decoder.new_cache(batch, max_length, **kwargs)

    def forward(self, src: Tensor, tgt: Tensor, *, src_padding_mask: Tensor | None = None,
                tgt_padding_mask: Tensor | None = None, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """Teacher-forced logits (B, T, V) for source ``src`` (B, S) and target input ``tgt`` (B, T).

        Padding masks are (B, S) / (B, T) booleans, True = real token. With ``return_attention``
        also returns the attention weights of every layer (computed by the reference kernel).
        """
        if isinstance(src, Tensor) and isinstance(tgt, Tensor) and src.dim() == tgt.dim() == 2 \
                and src.shape[0] != tgt.shape[0]:
            raise ValueError(f"source and target batch sizes differ: {src.shape[0]} vs "
                             f"{tgt.shape[0]}")
        memory, encoder_weights = self.encoder(src, src_padding_mask,
                                               need_weights=return_attention)
        hidden, decoder_weights, cross_weights = self.decoder(
            tgt, memory, padding_mask=tgt_padding_mask, memory_padding_mask=src_padding_mask,
            need_weights=return_attention)
        logits = self.generator(hidden)
        if return_attention:
            return logits, AttentionMaps(encoder_weights, decoder_weights, cross_weights)
        return logits
