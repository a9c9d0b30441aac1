"""Collect attention weights from any aiayn model, and cut them into per-sentence views.

The weights come from the models' ``return_attention=True`` path: each layer's output is still computed
by its own (e.g. fused) kernel and the weights by the reference kernel alongside, so the logits are the
same with and without collecting (tested).

Legend: B batch, L layers, H heads, T query length, S key length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from aiayn.models import (CausalLM, ImageClassifier, MaskedLM, SequenceClassifier, Transformer,
                          TransformerEncoder, VisionTransformer)
from aiayn.config import TransformerConfig
from aiayn.nn.stacks import AttentionMaps, sliding_layers
from aiayn.visualise.metrics import DEFAULT_WINDOW, PatternAccumulator, rows_from_means

# (key in AttentionMaps, title, causal, which tokens are queries / keys)
KINDS = {
    "encoder": ("encoder self-attention", False, "source", "source"),
    "decoder": ("decoder self-attention (masked)", True, "target", "target"),
    "cross": ("cross-attention (target attends to source)", False, "target", "source"),
}


@dataclass
class AttentionView:
    """One attention kind of one sentence, padding removed.

    ``weights`` (L, H, T, S); ``query_tokens`` T labels; ``key_tokens`` S labels; ``kind`` one of
    ``KINDS``; ``title`` for plots; ``causal`` whether queries see only earlier keys.
    """

    kind: str
    title: str
    weights: Tensor
    query_tokens: list[str]
    key_tokens: list[str]
    causal: bool


@torch.inference_mode()
def collect_attention(model: nn.Module, ids: Tensor, *, target_ids: Tensor | None = None,
                      padding_mask: Tensor | None = None,
                      target_padding_mask: Tensor | None = None) -> tuple[Tensor, AttentionMaps]:
    """Run ``model`` once and return its output and attention maps.

    Args:
        model: a ``Transformer`` (needs ``target_ids``), ``CausalLM``, ``TransformerEncoder``,
            ``SequenceClassifier`` or ``MaskedLM``.
        ids: (B, S) token ids (the source, for a Transformer).
        target_ids: (B, T) decoder input ids of a Transformer.
        padding_mask, target_padding_mask: (B, S) / (B, T) True = real token.

    Raises:
        ValueError: a Transformer without ``target_ids``, or ``target_ids`` for a model without a decoder
            input.
        TypeError: a model of another kind.
    """
    if isinstance(model, Transformer):
        if target_ids is None:
            raise ValueError("an encoder-decoder model needs target ids to show its decoder attention")
        return model(ids, target_ids, src_padding_mask=padding_mask,
                     tgt_padding_mask=target_padding_mask, return_attention=True)
    if target_ids is not None:
        raise ValueError(f"{type(model).__name__} takes one input sequence; target ids are only for "
                         "an encoder-decoder model")
    if isinstance(model, (CausalLM, TransformerEncoder, SequenceClassifier, MaskedLM)):
        return model(ids, padding_mask=padding_mask, return_attention=True)
    if isinstance(model, (ImageClassifier, VisionTransformer)):
        raise TypeError(f"{type(model).__name__} reads images, not token ids: use aiayn "
                        f"attention RUN_DIR --image FILE (or --test-image N)")
    raise TypeError(f"cannot collect attention from a {type(model).__name__}; expected an aiayn model")


def views_of(maps: AttentionMaps, index: int, *, source_tokens: Sequence[str] | None = None,
             target_tokens: Sequence[str] | None = None) -> list[AttentionView]:
    """The attention kinds present in ``maps`` for batch element ``index``, cut to its real tokens.

    A model with only a decoder (CausalLM) labels its tokens with ``target_tokens`` (or
    ``source_tokens`` when only those are given); encoder-only models use ``source_tokens``.

    Raises:
        ValueError: token labels longer than the weights.
    """
    views = []
    only_decoder = not maps.encoder and not maps.cross
    for kind, (title, causal, query_side, key_side) in KINDS.items():
        layers = getattr(maps, kind)
        if not layers:
            continue
        tokens = {"source": source_tokens, "target": target_tokens}
        if only_decoder and target_tokens is None:
            tokens["target"] = source_tokens
        query_labels, key_labels = tokens[query_side], tokens[key_side]
        stacked = torch.stack([layer[index] for layer in layers]).float().cpu()  # (L, H, T, S)
        queries = len(query_labels) if query_labels is not None else stacked.shape[2]
        keys = len(key_labels) if key_labels is not None else stacked.shape[3]
        if queries > stacked.shape[2] or keys > stacked.shape[3]:
            raise ValueError(f"{kind}: {queries} x {keys} token labels for weights of "
                             f"{stacked.shape[2]} x {stacked.shape[3]}")
        views.append(AttentionView(
            kind=kind, title=title, weights=stacked[:, :, :queries, :keys].contiguous(),
            query_tokens=list(query_labels) if query_labels is not None else
            [str(i) for i in range(queries)],
            key_tokens=list(key_labels) if key_labels is not None else [str(i) for i in range(keys)],
            causal=causal))
    return views


def update_patterns(accumulators: dict[tuple[str, int], PatternAccumulator], maps: AttentionMaps,
                    *, source_mask: Tensor | None = None, target_mask: Tensor | None = None,
                    window: int = DEFAULT_WINDOW, config: TransformerConfig | None = None) -> None:
    """Add one batch of ``maps`` to per-(kind, layer) pattern accumulators (created on first use).

    ``source_mask`` (B, S) / ``target_mask`` (B, T): True = real token; a decoder-only model's tokens
    are its target side (``source_mask`` is used when ``target_mask`` is not given). ``config``:
    the model's, whose sliding layers keep each query's allowed keys to the window.
    """
    only_decoder = not maps.encoder and not maps.cross
    masks = {"source": source_mask, "target": target_mask}
    if only_decoder and target_mask is None:
        masks["target"] = source_mask
    for kind, (_, causal, query_side, key_side) in KINDS.items():
        layers = getattr(maps, kind)
        slides = (sliding_layers(config, len(layers)) if layers and config is not None
                  and kind != "cross" else [False] * len(layers))
        for layer, weights in enumerate(layers):
            accumulator = accumulators.get((kind, layer))
            if accumulator is None:
                accumulator = accumulators[(kind, layer)] = PatternAccumulator(
                    n_heads=weights.shape[1], causal=causal, window=window,
                    band=config.sliding_window if slides[layer] else None)
            accumulator.update(weights, masks[query_side], masks[key_side])


def pattern_rows(accumulators: dict[tuple[str, int], PatternAccumulator]) -> list[dict]:
    """One metrics row per (attention kind, layer, head), in model order."""
    rows = []
    order = list(KINDS)
    for (kind, layer) in sorted(accumulators, key=lambda key: (order.index(key[0]), key[1])):
        rows.extend(rows_from_means(accumulators[(kind, layer)].means(), attention=kind,
                                    layer=layer))
    return rows
