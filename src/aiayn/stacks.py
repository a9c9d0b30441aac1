"""The encoder and decoder stacks (paper 3.1): embeddings, N identical layers, optional final norm.

Every model family is one or two of these stacks plus a head, so masks, caching, input checks and
attention maps live here once.

Legend: B batch, T target length, S source length, H heads, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn import packed_sequences
from aiayn.attention.cache import DecoderCache
from aiayn.attention.multihead import new_decoder_cache
from aiayn.config import TransformerConfig
from aiayn.embedding import Embeddings
from aiayn.layers import DecoderLayer, EncoderLayer
from aiayn.masks import check_padding_mask, key_padding_to_attention
from aiayn.normalisation import layer_norm


@dataclass
class AttentionMaps:
    """Attention weights per layer, each (B, H, T, S), computed by the reference kernel.

    ``encoder``: encoder self-attention; ``decoder``: decoder (masked) self-attention;
    ``cross``: decoder-to-encoder attention. Lists are empty for stacks a model does not have.
    """

    encoder: list[Tensor] = field(default_factory=list)
    decoder: list[Tensor] = field(default_factory=list)
    cross: list[Tensor] = field(default_factory=list)


def check_ids(ids: Tensor, name: str) -> None:
    """Token ids must be an integer (B, T) tensor with T >= 1; values are checked where data enters."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise TypeError(f"{name} must hold integer token ids (torch.long), got {ids.dtype}")
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (length 0)")


def final_norm(config: TransformerConfig) -> nn.Module | None:
    return layer_norm(config) if config.final_norm else None


class Encoder(nn.Module):
    """Token ids (B, S) -> hidden states (B, S, D).

    ``skips_padding``: a padded batch runs on its real tokens only where ``aiayn.packed_sequences``
    applies (False: always the padded batch; ``compile_layers`` sets it for compiled layers).
    """

    skips_padding = True

    def __init__(self, config: TransformerConfig, tokens: nn.Embedding):
        super().__init__()
        self.embeddings = Embeddings(config, tokens)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.norm = final_norm(config)

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None, *,
                token_types: Tensor | None = None, need_weights: bool = False
                ) -> tuple[Tensor, list[Tensor]]:
        """``padding_mask`` (B, S), True = real token. Returns hidden states and per-layer weights."""
        check_ids(ids, "ids")
        mask = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, *ids.shape)
            mask = key_padding_to_attention(padding_mask)  # (B, 1, 1, S)
        if token_types is not None and token_types.shape != ids.shape:
            raise ValueError(f"token_types must have the shape of ids {tuple(ids.shape)}, got "
                             f"{tuple(token_types.shape)}")
        x = self.embeddings(ids, token_types=token_types)  # (B, S, D)
        if padding_mask is not None and self.skips_padding and packed_sequences.applies(
                padding_mask, any(layer.self_attention.kernel.uses_positions
                                  for layer in self.layers)):
            return self._forward_packed(x, padding_mask, need_weights)
        return self.forward_embedded(x, mask, need_weights=need_weights)

    def _forward_packed(self, x: Tensor, padding_mask: Tensor, need_weights: bool
                        ) -> tuple[Tensor, list[Tensor]]:
        """The layers on the real tokens only (aiayn.packed_sequences); zeros at padded positions."""
        packed, where = packed_sequences.pack(x, padding_mask)  # (1, N, D)
        weights = []
        for layer in self.layers:
            packed, layer_weights = layer(packed, packed=where, need_weights=need_weights)
            if need_weights:
                weights.append(layer_weights)  # (B, H, S, S)
        if self.norm is not None:
            packed = self.norm(packed)
        return packed_sequences.unpack(packed, where), weights  # (B, S, D)

    def forward_embedded(self, x: Tensor, mask: Tensor | None = None, *,
                         need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        """The layers and final norm on already embedded inputs x (B, S, D).

        ``mask`` broadcasts to (B, H, S, S) (e.g. ``key_padding_to_attention(padding_mask)``).
        """
        weights = []
        for layer in self.layers:
            x, layer_weights = layer(x, mask, need_weights=need_weights)
            if need_weights:
                weights.append(layer_weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, weights


class Decoder(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, D), attending causally to itself and to ``memory``."""

    def __init__(self, config: TransformerConfig, tokens: nn.Embedding, *, cross_attention: bool):
        super().__init__()
        self.embeddings = Embeddings(config, tokens)
        self.layers = nn.ModuleList(DecoderLayer(config, cross_attention=cross_attention)
                                    for _ in range(config.n_decoder_layers))
        self.norm = final_norm(config)
        self.cross_attention = cross_attention
        self.max_length = config.max_length

    def new_cache(self, batch: int, max_length: int | None = None, *,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, rows_per_memory: int = 1) -> DecoderCache:
        """A preallocated cache for ``batch`` sequences of up to ``max_length`` positions.

        ``rows_per_memory`` G > 1 (beam search: the beam size): every G consecutive rows decode from
        the same source, so ``memory`` and ``memory_padding_mask`` are given once per source
        (batch / G rows) and their cross-attention keys/values are computed and kept once.

        Raises:
            ValueError: ``max_length`` exceeds the position table, or G does not divide ``batch``.
        """
        max_length = self.max_length if max_length is None else max_length
        if max_length > self.max_length:
            raise ValueError(f"cache of {max_length} positions exceeds the position table "
                             f"(max_length={self.max_length})")
        if isinstance(rows_per_memory, int) and rows_per_memory > 1:
            if not self.cross_attention:
                raise ValueError("rows_per_memory needs a decoder with cross-attention")
            if batch % rows_per_memory:
                raise ValueError(f"rows_per_memory={rows_per_memory} must divide the batch "
                                 f"({batch})")
        reference = self.embeddings.tokens.weight
        return new_decoder_cache([layer.self_attention for layer in self.layers], batch, max_length,
                                 device=device or reference.device, dtype=dtype or reference.dtype,
                                 rows_per_memory=rows_per_memory)

    def forward(self, ids: Tensor, memory: Tensor | None = None, *,
                padding_mask: Tensor | None = None, memory_padding_mask: Tensor | None = None,
                cache: DecoderCache | None = None, positions: Tensor | None = None,
                need_weights: bool = False) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run T new tokens ``ids`` (B, T).

        Without a cache they sit at positions 0..T-1 and ``padding_mask`` is (B, T). With a cache they
        sit at ``cache.length ..`` and ``padding_mask`` covers every key so far, (B, cache.length + T);
        the cache advances by T. ``memory`` (B, S, D) and ``memory_padding_mask`` (B, S) feed the
        cross-attention (needed on the first cached step only). Returns hidden states, self- and
        cross-attention weights per layer (empty lists unless ``need_weights``).
        """
        check_ids(ids, "target ids")
        batch, length = ids.shape
        start = 0 if cache is None else cache.length
        if cache is not None and start + length > cache.max_length:
            raise ValueError(f"decoding to {start + length} positions overflows the cache of "
                             f"{cache.max_length}")
        self_mask = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, batch, start + length)
            self_mask = key_padding_to_attention(padding_mask)  # (B, 1, 1, start + T)
        memory_mask = None
        if self.cross_attention:
            if memory is None and (cache is None or cache.cross[0] is None):
                raise ValueError("the decoder of an encoder-decoder model needs the encoder output")
            group = 1 if cache is None else cache.rows_per_memory
            if batch % group:
                raise ValueError(f"the cache shares each memory row among {group} rows, but the "
                                 f"batch has {batch} rows")
            sources = batch // group  # memory rows (B / G)
            if memory is not None:
                if memory.dim() != 3 or memory.shape[0] != sources:
                    raise ValueError(f"memory must have shape (B={sources}, S, D), got "
                                     f"{tuple(memory.shape)}")
            if memory_padding_mask is not None:
                source_length = memory.shape[1] if memory is not None else cache.source_length
                check_padding_mask(memory_padding_mask, sources, source_length,
                                   "memory_padding_mask")
                memory_mask = key_padding_to_attention(memory_padding_mask)  # (B, 1, 1, S)
        if positions is not None and tuple(positions.shape) != (batch, length):
            raise ValueError(f"positions must have shape (B={batch}, T={length}), got "
                             f"{tuple(positions.shape)}")
        x = self.embeddings(ids, start=start, positions=positions)  # (B, T, D)
        return self.forward_embedded(x, memory, self_mask=self_mask, memory_mask=memory_mask,
                                     cache=cache, need_weights=need_weights)

    def forward_embedded(self, x: Tensor, memory: Tensor | None = None, *,
                         self_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                         cache: DecoderCache | None = None, need_weights: bool = False
                         ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The layers and final norm on already embedded inputs x (B, T, D).

        ``self_mask`` broadcasts to (B, H, T, T_keys) and is combined with the causal mask;
        ``memory_mask`` broadcasts to (B, H, T, S).
        """
        self_weights, cross_weights = [], []
        for index, layer in enumerate(self.layers):
            x, self_w, cross_w = layer(x, memory, self_mask=self_mask, memory_mask=memory_mask,
                                       cache=cache, layer_index=index, need_weights=need_weights)
            if need_weights:
                self_weights.append(self_w)
                if cross_w is not None:
                    cross_weights.append(cross_w)
        if self.norm is not None:
            x = self.norm(x)
        if cache is not None:
            cache.length += x.shape[1]
        return x, self_weights, cross_weights
