"""The encoder and decoder stacks (paper 3.1): embeddings, N identical layers, optional final norm.

Every model family is one or two of these stacks plus a head, so masks, caching, input checks and
attention maps live here once. Positions that act inside attention are computed here once per call and
handed to every layer: the rotation of rotary positions (Su et al. 2021), T5's relative position
bias (Raffel et al. 2020), bidirectional in the encoder and causal in the decoder, and DeBERTa's
relative embeddings (He et al. 2021; aiayn.nn.disentangled), in the encoder.

Legend: B batch, T target length, S source length, H heads, D model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from aiayn.nn.attention.cache import DecoderCache
from aiayn.config import TransformerConfig
from aiayn.nn.disentangled import RelativeEmbeddings, disentangled_spec
from aiayn.nn.embedding import Embeddings
from aiayn.nn.layers import DecoderLayer, EncoderLayer
from aiayn.masks import cache_window_mask, check_padding_mask, key_padding_to_attention
from aiayn.nn.norms import layer_norm
from aiayn.nn.relative_bias import RelativePositionBias
from aiayn.nn.rotary import RotaryEmbedding, Rotation


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


def check_token_types(token_types: Tensor, shape: tuple[int, ...]) -> None:
    """Segment ids must be an integer tensor of the ids' ``shape``; their range is checked by the
    embedding lookup (``Embeddings.forward``)."""
    if not isinstance(token_types, Tensor):
        raise TypeError(f"token_types must be a tensor of segment ids, got "
                        f"{type(token_types).__name__}")
    if token_types.dtype not in (torch.long, torch.int32, torch.int64):
        raise TypeError(f"token_types must hold integer segment ids (torch.long), got "
                        f"{token_types.dtype}")
    if tuple(token_types.shape) != shape:
        raise ValueError(f"token_types must have the shape of ids {shape}, got "
                         f"{tuple(token_types.shape)}")


def check_positions(positions: Tensor, batch: int, length: int,
                    max_length: int | None) -> None:
    """Explicit positions must be an integer (B, T) tensor of values in [0, max_length) (None: no
    upper bound).

    The range is read only from CPU tensors outside ``torch.compile``: on a GPU it would cost every
    decoding step a device-to-host read, which a CUDA graph capture forbids (there an index past the
    table asserts on the device; a negative one would wrap to the table's end).
    """
    if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.is_complex() \
            or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")
    if tuple(positions.shape) != (batch, length):
        raise ValueError(f"positions must have shape (B={batch}, T={length}), got "
                         f"{tuple(positions.shape)}")
    if positions.device.type == "cpu" and not torch.compiler.is_compiling():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or (max_length is not None and high >= max_length):
            upper = "..." if max_length is None else f"max_length={max_length}"
            raise ValueError(f"positions must lie in [0, {upper}), got positions from {low} to "
                             f"{high}")


def final_norm(config: TransformerConfig) -> nn.Module | None:
    return layer_norm(config) if config.final_norm else None


def make_rotary(config: TransformerConfig, *, local: bool = False) -> RotaryEmbedding | None:
    """The rotary positions of the config (``local``: of its sliding layers, when they have a base
    of their own, ``rope_local_theta``, unscaled), or None."""
    if config.positions != "rotary":
        return None
    if local:
        if config.rope_local_theta is None:
            return None
        return RotaryEmbedding(config.rotary_dim, config.rope_local_theta, config.max_length)
    return RotaryEmbedding(config.rotary_dim, config.rope_theta, config.max_length,
                           config.rope_scaling)


def sliding_layers(config: TransformerConfig, layers: int) -> list[bool]:
    """Whether each of a stack's ``layers`` layers slides (``sliding_window_layers``; None: all);
    a ValueError for an index past the stack (the config checks only the deeper of its two)."""
    chosen = config.sliding_window_layers
    if config.sliding_window is not None and chosen is not None and max(chosen) >= layers:
        raise ValueError(f"sliding_window_layers={chosen} names layer {max(chosen)}, but this "
                         f"stack has {layers} layers (indices 0 to {layers - 1})")
    return [config.sliding_window is not None and (chosen is None or index in chosen)
            for index in range(layers)]


def make_position_bias(config: TransformerConfig, *, bidirectional: bool
                       ) -> RelativePositionBias | None:
    if not config.relative_attention_buckets:
        return None
    return RelativePositionBias(config.relative_attention_buckets,
                                config.relative_attention_max_distance, config.n_heads,
                                bidirectional=bidirectional)


class Encoder(nn.Module):
    """Token ids (B, S) -> hidden states (B, S, D).

    ``tokens=None``: no embeddings; the caller embeds its inputs (the Vision Transformer's patches)
    and calls ``forward_embedded``. With ``config.sliding_window`` W the sliding layers (ModernBERT's
    local attention) see only the keys less than W positions away on either side, with the RoPE
    base of their own (``rope_local_theta``) when the config gives one.
    """

    def __init__(self, config: TransformerConfig, tokens: nn.Embedding | None):
        super().__init__()
        self.embeddings = Embeddings(config, tokens) if tokens is not None else None
        self.skip_padding = config.positions_skip_padding
        self.rotary = make_rotary(config)
        self.rotary_local = make_rotary(config, local=True)  # the sliding layers' own, or None
        self.position_bias = make_position_bias(config, bidirectional=True)
        spec = disentangled_spec(config)
        self.relative = None if spec is None else RelativeEmbeddings(
            spec, config.d_model, eps=config.layer_norm_eps, dropout=config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config, first=index == 0)
                                    for index in range(config.n_encoder_layers))
        self.norm = final_norm(config)
        self.window = config.sliding_window
        self.sliding = sliding_layers(config, config.n_encoder_layers)

    def forward(self, ids: Tensor, padding_mask: Tensor | None = None, *,
                token_types: Tensor | None = None, need_weights: bool = False
                ) -> tuple[Tensor, list[Tensor]]:
        """``padding_mask`` (B, S), True = real token. Returns hidden states and per-layer weights."""
        if self.embeddings is None:
            raise TypeError("this encoder has no token embeddings; call forward_embedded")
        check_ids(ids, "ids")
        mask = positions = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, *ids.shape)
            mask = key_padding_to_attention(padding_mask)  # (B, 1, 1, S)
            if self.skip_padding:
                positions = self.embeddings.real_positions(padding_mask)  # (B, S)
        if token_types is not None:
            check_token_types(token_types, tuple(ids.shape))
        x = self.embeddings(ids, token_types=token_types, positions=positions)  # (B, S, D)
        return self.forward_embedded(x, mask, need_weights=need_weights)

    def forward_embedded(self, x: Tensor, mask: Tensor | None = None, *,
                         need_weights: bool = False) -> tuple[Tensor, list[Tensor]]:
        """The layers and final norm on already embedded inputs x (B, S, D).

        ``mask`` broadcasts to (B, H, S, S) (e.g. ``key_padding_to_attention(padding_mask)``).
        """
        length = x.shape[1]
        rotation = local_rotation = None
        if self.rotary is not None:
            positions = torch.arange(length, device=x.device)  # (S,)
            rotation = local_rotation = self.rotary(positions)  # (S, Dh) x 2
            if self.rotary_local is not None:
                local_rotation = self.rotary_local(positions)
        bias = None if self.position_bias is None else self.position_bias(length, length)
        relative = None if self.relative is None else self.relative(length)
        weights = []
        for layer, sliding in zip(self.layers, self.sliding):
            x, layer_weights = layer(x, mask, band=self.window if sliding else None,
                                     rotation=local_rotation if sliding else rotation,
                                     position_bias=bias, relative=relative,
                                     need_weights=need_weights)
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
        self.rotary = make_rotary(config)
        self.rotary_local = make_rotary(config, local=True)  # the sliding layers' own, or None
        self.position_bias = make_position_bias(config, bidirectional=False)
        self.layers = nn.ModuleList(DecoderLayer(config, cross_attention=cross_attention,
                                                 first=index == 0)
                                    for index in range(config.n_decoder_layers))
        self.norm = final_norm(config)
        self.cross_attention = cross_attention
        self.max_length = config.max_length  # a new cache's default capacity
        self.window = config.sliding_window  # sliding layers see only the last `window` keys
        self.sliding = sliding_layers(config, config.n_decoder_layers)

    def new_cache(self, batch: int, max_length: int | None = None, *,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None, rows_per_memory: int = 1) -> DecoderCache:
        """A preallocated cache for ``batch`` sequences of up to ``max_length`` positions (default:
        the config's ``max_length``).

        ``rows_per_memory`` G > 1 (beam search: the beam size): every G consecutive rows decode from
        the same source, so ``memory`` and ``memory_padding_mask`` are given once per source
        (batch / G rows) and their cross-attention keys/values are computed and kept once.

        Raises:
            ValueError: ``max_length`` exceeds the position table, or G does not divide ``batch``.
        """
        max_length = self.max_length if max_length is None else max_length
        limit = self.embeddings.position_limit  # None: any length (T5's relative bias)
        if limit is not None and max_length > limit:
            raise ValueError(f"cache of {max_length} positions exceeds the position table "
                             f"(max_length={limit})")
        if isinstance(rows_per_memory, int) and rows_per_memory > 1:
            if not self.cross_attention:
                raise ValueError("rows_per_memory needs a decoder with cross-attention")
            if batch % rows_per_memory:
                raise ValueError(f"rows_per_memory={rows_per_memory} must divide the batch "
                                 f"({batch})")
        reference = self.embeddings.tokens.weight
        device, dtype = device or reference.device, dtype or reference.dtype
        # Only the key/value heads are kept; a sliding layer keeps its window (a ring of W slots)
        # unless a position bias is laid out by position over every key.
        ring = self.window if self.position_bias is None else None
        layers = [layer.self_attention.kernel.new_cache(
            batch, layer.self_attention.n_kv_heads, max_length, layer.self_attention.head_dim,
            window=ring if sliding else None, device=device, dtype=dtype)
            for layer, sliding in zip(self.layers, self.sliding)]
        return DecoderCache(layers, max_length, rows_per_memory=rows_per_memory)

    def forward(self, ids: Tensor, memory: Tensor | None = None, *,
                padding_mask: Tensor | None = None, memory_padding_mask: Tensor | None = None,
                cache: DecoderCache | None = None, positions: Tensor | None = None,
                slots: Tensor | None = None, need_weights: bool = False
                ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Run T new tokens ``ids`` (B, T).

        Without a cache they sit at positions 0..T-1 and ``padding_mask`` is (B, T). With a cache they
        sit at ``cache.length ..`` and ``padding_mask`` covers every key so far, (B, cache.length + T);
        the cache advances by T. ``memory`` (B, S, D) and ``memory_padding_mask`` (B, S) feed the
        cross-attention (needed on the first cached step only). Returns hidden states, self- and
        cross-attention weights per layer (empty lists unless ``need_weights``).

        ``slots`` (1,): a fixed-shape step (what a CUDA graph replays): the one new token is written
        to that cache slot, it attends over every slot of the cache, ``padding_mask`` (B, C) says
        which hold keys, ``positions`` (B, 1) are required, and ``cache.length`` is neither read nor
        advanced (the caller counts).
        """
        check_ids(ids, "target ids")
        batch, length = ids.shape
        if cache is not None and cache.batch not in (None, batch):
            raise ValueError(f"the ids have {batch} rows but the cache holds {cache.batch}: make it "
                             f"with new_cache(batch={batch}, ...)")
        if slots is not None:
            self._check_slots(slots, cache, padding_mask, positions, length)
            start, keys = slots, cache.max_length
        else:
            start = 0 if cache is None else cache.length
            keys = start + length
            if cache is not None and keys > cache.max_length:
                raise ValueError(f"decoding to {keys} positions overflows the cache of "
                                 f"{cache.max_length}")
        self_mask = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, batch, keys)
            self_mask = key_padding_to_attention(padding_mask)  # (B, 1, 1, keys)
        memory_mask = self._memory_mask(memory, memory_padding_mask, cache, batch)
        if positions is not None:
            check_positions(positions, batch, length, self.embeddings.position_limit)
        x = self.embeddings(ids, start=0 if slots is not None else start,
                            positions=positions)  # (B, T, D)
        return self.forward_embedded(x, memory, self_mask=self_mask, memory_mask=memory_mask,
                                     cache=cache, start=start, advance=slots is None,
                                     positions=positions, need_weights=need_weights)

    @staticmethod
    def _check_slots(slots: Tensor, cache: DecoderCache | None, padding_mask: Tensor | None,
                     positions: Tensor | None, length: int) -> None:
        if cache is None or padding_mask is None or positions is None:
            raise ValueError("slots need a cache, a padding_mask over its slots and positions")
        if length != 1 or tuple(slots.shape) != (1,) or slots.dtype != torch.long:
            raise ValueError(f"slots decode one token at a time: a (1,) long tensor and ids "
                             f"(B, 1), got slots {slots.dtype} {tuple(slots.shape)} and {length} "
                             f"tokens")

    def _memory_mask(self, memory: Tensor | None, memory_padding_mask: Tensor | None,
                     cache: DecoderCache | None, batch: int) -> Tensor | None:
        """The cross-attention mask (B / G, 1, 1, S) after checking the memory's shapes."""
        if not self.cross_attention:
            return None
        if memory is None and (cache is None or cache.source_length is None):
            raise ValueError("the decoder of an encoder-decoder model needs the encoder output")
        group = 1 if cache is None else cache.rows_per_memory
        if batch % group:
            raise ValueError(f"the cache shares each memory row among {group} rows, but the "
                             f"batch has {batch} rows")
        sources = batch // group  # memory rows (B / G)
        if memory is not None and (memory.dim() != 3 or memory.shape[0] != sources):
            raise ValueError(f"memory must have shape (B={sources}, S, D), got "
                             f"{tuple(memory.shape)}")
        if memory_padding_mask is None:
            return None
        source_length = memory.shape[1] if memory is not None else cache.source_length
        check_padding_mask(memory_padding_mask, sources, source_length, "memory_padding_mask")
        return key_padding_to_attention(memory_padding_mask)  # (B / G, 1, 1, S)

    def forward_embedded(self, x: Tensor, memory: Tensor | None = None, *,
                         self_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                         cache: DecoderCache | None = None, start: int | Tensor | None = None,
                         advance: bool = True, positions: Tensor | None = None,
                         need_weights: bool = False) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The layers and final norm on already embedded inputs x (B, T, D).

        ``self_mask`` broadcasts to (B, H, T, T_keys) and is combined with the causal mask;
        ``memory_mask`` broadcasts to (B, H, T, S). With a cache, x sits at ``start`` (default
        ``cache.length``), which advances by T unless ``advance`` is False. ``positions`` (B, T):
        x's positions when they are not ``start ..`` (left padding, fixed-shape steps).
        """
        if start is None:
            start = 0 if cache is None else cache.length
        rotation = self._rotation(self.rotary, x, start, positions)
        local_rotation = rotation if self.rotary_local is None else \
            self._rotation(self.rotary_local, x, start, positions)
        bias = self._position_bias(x, start, positions)
        # A whole sequence (no cache, or an empty one): the sliding layers get the window as a band
        # (the kernel may attend block by block); else the window over cache slots as a mask.
        whole = not isinstance(start, Tensor) and start == 0
        band = self.window if whole else None
        sliding_mask = None if whole else self._sliding_mask(x, start, cache, self_mask)
        self_weights, cross_weights = [], []
        for index, layer in enumerate(self.layers):
            sliding = self.sliding[index]
            x, self_w, cross_w = layer(
                x, memory, memory_mask=memory_mask, start=start,
                self_mask=sliding_mask if sliding and sliding_mask is not None else self_mask,
                band=band if sliding else None,
                rotation=local_rotation if sliding else rotation, position_bias=bias,
                cache=None if cache is None else cache.self_attention[index],
                memory_cache=None if cache is None else cache.cross[index],
                need_weights=need_weights)
            if need_weights:
                self_weights.append(self_w)
                if cross_w is not None:
                    cross_weights.append(cross_w)
        if self.norm is not None:
            x = self.norm(x)
        if cache is not None and advance:
            cache.length += x.shape[1]
        return x, self_weights, cross_weights

    def _sliding_mask(self, x: Tensor, start: int | Tensor, cache: DecoderCache | None,
                      self_mask: Tensor | None) -> Tensor | None:
        """The sliding layers' self-attention mask over the keys their caches return (T, S), or
        (B, 1, T, S) with ``self_mask`` (B, 1, 1, keys so far) gathered to those keys: the window
        over cache slots (as transformers counts it, left padding included); None when no key can
        fall out of the window."""
        if self.window is None or not any(self.sliding):
            return None
        length = x.shape[1]
        if isinstance(start, Tensor):  # a fixed-shape step: one query at that slot
            slots = start
        else:
            if start + length <= self.window:
                return None
            slots = torch.arange(start, start + length, device=x.device)  # (T,)
        if cache is None:  # keys 0 .. start + T - 1, given with the queries
            keys = torch.arange(start + length, device=x.device)  # (S,)
        else:  # the position of each key the sliding layers' caches return, (S,)
            keys = cache.self_attention[self.sliding.index(True)].key_slots(start, length)
        return cache_window_mask(slots, keys, self.window, self_mask)  # (T, S) or (B, 1, T, S)

    @staticmethod
    def _rotation(rotary: RotaryEmbedding | None, x: Tensor, start: int | Tensor,
                  positions: Tensor | None) -> Rotation | None:
        """(cos, sin) of x's positions: ``positions`` (B, T), else start .. start + T - 1."""
        if rotary is None:
            return None
        if positions is None:
            if isinstance(start, Tensor):
                raise ValueError("a fixed-shape step (slots) needs explicit positions")
            positions = torch.arange(start, start + x.shape[1], device=x.device)  # (T,)
        return rotary(positions)

    def _position_bias(self, x: Tensor, start: int | Tensor, positions: Tensor | None
                       ) -> Tensor | None:
        """T5's causal bias (1, H, T, keys) of queries start .. over keys 0 .. start + T - 1."""
        if self.position_bias is None:
            return None
        if positions is not None or isinstance(start, Tensor):
            raise ValueError("a relative position bias needs contiguous positions from 0: "
                             "left-padded batches (explicit positions) and fixed-shape steps "
                             "are not supported; pad on the right")
        return self.position_bias(x.shape[1], start + x.shape[1], start)
