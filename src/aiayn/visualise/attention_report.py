"""The whole attention report of a model on tokenised texts: grids, zoom, metrics, HTML.

``write_attention_report`` draws the first example (layer x head grids per attention kind, a zoom of
one head) and measures the pattern metrics over every example, batched with right padding (the metrics
are padding-aware, so batching does not change them). ``aiayn attention`` is a thin layer over it.

Legend: B batch, L layers, H heads, T target length, S source length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from aiayn.visualise.collect import (AttentionView, collect_attention, pattern_rows, update_patterns,
                                     views_of)
from aiayn.visualise.metrics import DEFAULT_WINDOW, PatternAccumulator, write_metrics


@dataclass
class Example:
    """One tokenised text: ids and their display labels; ``target_*`` for encoder-decoder models
    (the decoder input, e.g. ``<s>`` + target tokens)."""

    source_ids: list[int]
    source_tokens: list[str]
    target_ids: list[int] | None = None
    target_tokens: list[str] | None = None

    def __post_init__(self) -> None:
        if not self.source_ids:
            raise ValueError("an example has no tokens")
        if len(self.source_ids) != len(self.source_tokens):
            raise ValueError(f"{len(self.source_ids)} source ids but {len(self.source_tokens)} labels")
        if (self.target_ids is None) != (self.target_tokens is None):
            raise ValueError("give both target ids and target labels, or neither")
        if self.target_ids is not None and (
                not self.target_ids or len(self.target_ids) != len(self.target_tokens)):
            raise ValueError(f"{len(self.target_ids)} target ids but {len(self.target_tokens)} labels")


def _pad(sequences: Sequence[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ids (B, L) and their mask (B, L), True = real token."""
    longest = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    return ids, torch.arange(longest)[None, :] < lengths[:, None]


def _check_lengths(model: nn.Module, example: Example) -> None:
    limit = getattr(getattr(model, "config", None), "max_length", None)
    if limit is None or getattr(model.config, "positions", "sinusoidal") == "none":
        return
    for side, ids in (("source", example.source_ids), ("target", example.target_ids)):
        if ids is not None and len(ids) > limit:
            raise ValueError(f"the {side} text has {len(ids)} tokens, more than the model's "
                             f"max_length {limit}")


def measure_patterns(model: nn.Module, examples: Sequence[Example], *, window: int = DEFAULT_WINDOW,
                     batch_size: int = 16, pad_id: int | None = None) -> list[dict]:
    """Per-head pattern metrics (one row per attention kind, layer and head) over ``examples``.

    Raises:
        ValueError: no examples, or a text longer than the model's position table.
    """
    if not examples:
        raise ValueError("no examples to measure")
    pad_id = model.config.pad_id if pad_id is None else pad_id
    accumulators: dict[tuple[str, int], PatternAccumulator] = {}
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        for example in chunk:
            _check_lengths(model, example)
        source, source_mask = _pad([e.source_ids for e in chunk], pad_id)
        target = target_mask = None
        if chunk[0].target_ids is not None:
            target, target_mask = _pad([e.target_ids for e in chunk], pad_id)
        _, maps = collect_attention(model, source, target_ids=target, padding_mask=source_mask,
                                    target_padding_mask=target_mask)
        update_patterns(accumulators, maps, source_mask=source_mask, target_mask=target_mask,
                        window=window, config=model.config)
    return pattern_rows(accumulators)


def example_views(model: nn.Module, example: Example) -> list[AttentionView]:
    """The attention views (per kind, padding-free) of one example."""
    _check_lengths(model, example)
    source = torch.tensor([example.source_ids], dtype=torch.long)
    target = (torch.tensor([example.target_ids], dtype=torch.long)
              if example.target_ids is not None else None)
    _, maps = collect_attention(model, source, target_ids=target)
    return views_of(maps, 0, source_tokens=example.source_tokens,
                    target_tokens=example.target_tokens)


def write_attention_report(model: nn.Module, examples: Sequence[Example], out_dir: str | Path, *,
                           layer: int | None = None, head: int | None = None,
                           kind: str | None = None, html: bool = False,
                           window: int = DEFAULT_WINDOW, title: str = "attention",
                           dpi: int = 110) -> dict[str, Path]:
    """Write the report of ``examples`` into ``out_dir``; returns the written files by name.

    Files: ``<kind>_grid.png`` per attention kind (the first example), ``<kind>_L<l>_H<h>.png`` (a
    zoom of one head: ``layer``/``head``, default the last layer's head 0, in every kind unless
    ``kind`` names one), ``metrics.json`` and ``metrics.csv`` (all examples), and ``attention.html``
    with ``html``.

    Raises:
        ValueError: no examples, a layer/head/kind the model does not have, a text too long.
    """
    from aiayn.visualise.heatmaps import plot_attention_grid, plot_attention_head
    from aiayn.visualise.report_html import write_attention_html

    if not examples:
        raise ValueError("no texts to report on")
    out_dir = Path(out_dir)
    views = example_views(model, examples[0])
    kinds = [view.kind for view in views]
    if kind is not None and kind not in kinds:
        raise ValueError(f"--kind {kind!r}: this model has {kinds}")
    for view in views:
        if kind is not None and view.kind != kind:
            continue  # only the kind drawn: a decoder layer the encoder lacks is no error
        layers, heads = view.weights.shape[:2]
        if layer is not None and not 0 <= layer < layers:
            raise ValueError(f"--layer {layer}: {view.kind} attention has layers 0..{layers - 1}")
        if head is not None and not 0 <= head < heads:
            raise ValueError(f"--head {head}: {view.kind} attention has heads 0..{heads - 1}")
    rows = measure_patterns(model, examples, window=window)
    labels = {(row["attention"], row["layer"], row["head"]): row["label"] for row in rows}
    written: dict[str, Path] = {}
    for view in views:
        layers, heads = view.weights.shape[:2]
        head_labels = [[labels[(view.kind, l, h)] for h in range(heads)] for l in range(layers)]
        written[f"{view.kind}_grid"] = plot_attention_grid(
            view.weights, view.query_tokens, view.key_tokens, out_dir / f"{view.kind}_grid.png",
            title=f"{title}: {view.title}", head_labels=head_labels, dpi=dpi)
        if kind is not None and view.kind != kind:
            continue
        zoom_layer = layers - 1 if layer is None else layer
        zoom_head = 0 if head is None else head
        name = f"{view.kind}_L{zoom_layer}_H{zoom_head}"
        written[name] = plot_attention_head(
            view.weights[zoom_layer, zoom_head], view.query_tokens, view.key_tokens,
            out_dir / f"{name}.png",
            title=f"{title}: {view.title}, layer {zoom_layer} head {zoom_head} "
                  f"({labels[(view.kind, zoom_layer, zoom_head)]})", dpi=dpi)
    write_metrics(rows, out_dir / "metrics.json", out_dir / "metrics.csv")
    written["metrics.json"] = out_dir / "metrics.json"
    written["metrics.csv"] = out_dir / "metrics.csv"
    if html:
        written["html"] = write_attention_html(views, out_dir / "attention.html", title=title,
                                               labels=labels)
    return written
