"""Decoder-only causal language model (GPT-style): the paper's decoder without cross-attention.

Legend: B batch, T length, D model width, V vocabulary.
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.nn.attention.cache import DecoderCache
from aiayn.config import TransformerConfig
from aiayn.models.heads import OutputProjection, initialise
from aiayn.nn.embedding import token_embedding
from aiayn.nn.stacks import AttentionMaps, Decoder


class CausalLM(nn.Module):
    """Next-token logits (B, T, V) for token ids (B, T); layers = ``config.n_decoder_layers``.

    Example:
        >>> import torch
        >>> from aiayn import CausalLM, TransformerConfig
        >>> model = CausalLM(TransformerConfig.preset("tiny", norm_first=True)).eval()
        >>> prompt = torch.randint(3, 100, (1, 8))
        >>> cache = model.new_cache(batch=1, max_length=32)
        >>> model(prompt, cache=cache).shape  # then one token at a time with the same cache
        torch.Size([1, 8, 100])
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        tokens = token_embedding(config, config.vocab_size)
        self.decoder = Decoder(config, tokens, cross_attention=False)
        self.lm_head = OutputProjection(config, tokens, tied=config.tie_output)
        initialise(self, config)

    def new_cache(self, batch: int, max_length: int | None = None, **kwargs) -> DecoderCache:
        """A static cache for incremental decoding of ``batch`` sequences."""
        return self.decoder.new_cache(batch, max_length, **kwargs)

    def hidden_states(self, ids: Tensor, *, padding_mask: Tensor | None = None,
                      positions: Tensor | None = None, cache: DecoderCache | None = None,
                      slots: Tensor | None = None) -> Tensor:
        """Final hidden states (B, T, D) before the output projection."""
        return self.decoder(ids, padding_mask=padding_mask, positions=positions, cache=cache,
                            slots=slots)[0]

    def forward(self, ids: Tensor, *, padding_mask: Tensor | None = None,
                positions: Tensor | None = None, cache: DecoderCache | None = None,
                slots: Tensor | None = None, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """Logits (B, T, V). ``padding_mask``: (B, T), or (B, cache.length + T) with a cache.

        ``positions`` (B, T) overrides the default positions (needed for left-padded prompts);
        ``slots``: a fixed-shape decoding step (``Decoder.forward``).
        """
        hidden, weights, _ = self.decoder(ids, padding_mask=padding_mask, positions=positions,
                                          cache=cache, slots=slots, need_weights=return_attention)
        logits = self.lm_head(hidden)
        if return_attention:
            return logits, AttentionMaps(decoder=weights)
        return logits
