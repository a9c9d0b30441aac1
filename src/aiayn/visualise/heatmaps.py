"""Attention heatmaps: a layer x head grid on one colour scale, and a single-head zoom.

The zoom prints each weight in its cell for heads of up to ``PRINTED_UP_TO`` (40) tokens a side,
leaving cells that print as 0.00 blank; a longer head is drawn in colours only.

Rows of a heatmap are queries (the tokens attending), columns are keys (the tokens attended to),
as in the paper's Figures 3-5. Font and panel sizes scale with the number of tokens so that
sentences of up to 40 tokens keep every label legible and unclipped (saved with
``bbox_inches="tight"``).

matplotlib is imported inside the functions, on the Agg backend (no display needed).

Legend: L layers, H heads, T query length, S key length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from torch import Tensor

from aiayn.visualise.files import atomic_path

COLOUR_MAP = "viridis"
# The zoomed head prints its weights up to this many tokens a side: at 0.34 inch a cell, 40 tokens
# make an image about 13 inches (1,430 pixels at 110 dpi) wide, which a screen shows at full size
# with 8-point numbers; a longer head is scaled down until they cannot be read, and each printed
# weight costs draw time (every text is laid out twice by a tight ``savefig``).
PRINTED_UP_TO = 40


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def display_token(token: str) -> str:
    """A token as a tick label: mathtext ``$`` escaped, empty or blank tokens made visible."""
    token = token.replace("$", r"\$")
    return token if token.strip() else repr(token)


def _check_labels(weights_shape: tuple[int, ...], query_tokens: Sequence[str],
                  key_tokens: Sequence[str]) -> None:
    queries, keys = weights_shape[-2:]
    if len(query_tokens) != queries or len(key_tokens) != keys:
        raise ValueError(f"token labels ({len(query_tokens)} queries, {len(key_tokens)} keys) do "
                         f"not match the weights (T={queries}, S={keys})")


def _font_size(slot_inches: float) -> float:
    """A font size (points) that fits a tick slot of ``slot_inches``."""
    return max(4.5, min(10.0, slot_inches * 72 * 0.72))


def save_figure(figure, path: str | Path, dpi: int) -> Path:
    """Save atomically with a tight bounding box (nothing clipped) and close the figure.

    Raises:
        ValueError: dpi outside 20..600.
    """
    plt = pyplot()
    if not 20 <= dpi <= 600:
        plt.close(figure)
        raise ValueError(f"dpi must be between 20 and 600, got {dpi}")
    path = Path(path)
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=dpi, bbox_inches="tight", pad_inches=0.15,
                       format=path.suffix.lstrip(".") or "png")
    plt.close(figure)
    return path


def plot_attention_grid(weights: Tensor, query_tokens: Sequence[str], key_tokens: Sequence[str],
                        path: str | Path, *, title: str,
                        head_labels: Sequence[Sequence[str]] | None = None,
                        query_axis: str = "query (attending)", key_axis: str = "key (attended to)",
                        dpi: int = 110) -> Path:
    """Draw every layer and head of one attention kind as a grid of heatmaps and save it.

    Args:
        weights: (L, H, T, S) attention weights of one sentence.
        query_tokens: T row labels; key_tokens: S column labels.
        path: output image (``.png`` / ``.svg`` / ``.pdf``).
        title: figure title.
        head_labels: optional (L, H) pattern labels, shown in each panel title.
        query_axis, key_axis: axis titles.
        dpi: resolution of raster output.

    Raises:
        ValueError: weights not 4-D, or labels that do not match T / S.
    """
    if weights.dim() != 4:
        raise ValueError(f"grid weights must have shape (L, H, T, S), got {tuple(weights.shape)}")
    _check_labels(tuple(weights.shape), query_tokens, key_tokens)
    plt = pyplot()
    layers, heads, queries, keys = weights.shape
    values = weights.detach().float().cpu().numpy()
    slot = 0.14  # inches per token in a panel
    panel_w, panel_h = max(1.5, slot * keys), max(1.5, slot * queries)
    font = _font_size(min(panel_w / keys, panel_h / queries))
    gap_w, gap_h = 0.15, 0.55  # inches between panels (room for the panel titles)
    bar_w = 0.25
    width = heads * panel_w + (heads - 1) * gap_w + 2 * gap_w + bar_w
    height = layers * panel_h + (layers - 1) * gap_h
    # A fixed grid (no constrained layout: it measures every tick label, slow for big grids); the
    # tick labels sit outside the grid and bbox_inches="tight" keeps them in the saved image.
    figure = plt.figure(figsize=(width, height))
    grid = figure.add_gridspec(layers, heads + 1, left=0, right=1, bottom=0, top=1,
                               width_ratios=[panel_w] * heads + [2 * gap_w + bar_w],
                               wspace=gap_w / panel_w, hspace=gap_h / panel_h)
    vmax = float(values.max()) if values.size and values.max() > 0 else 1.0
    image = None
    for layer in range(layers):
        for head in range(heads):
            axis = figure.add_subplot(grid[layer, head])
            image = axis.imshow(values[layer, head], cmap=COLOUR_MAP, vmin=0.0, vmax=vmax,
                                aspect="auto", interpolation="nearest")
            name = f"L{layer} H{head}"
            if head_labels is not None:
                name += f": {head_labels[layer][head]}"
            axis.set_title(name, fontsize=max(font, 8), pad=3)
            axis.tick_params(length=0, labelsize=font)
            if layer == layers - 1:  # token labels on the outer axes only
                axis.set_xticks(range(keys))
                axis.set_xticklabels([display_token(t) for t in key_tokens], rotation=90)
                axis.set_xlabel(key_axis, fontsize=max(font, 8))
            else:
                axis.set_xticks([])
            if head == 0:
                axis.set_yticks(range(queries))
                axis.set_yticklabels([display_token(t) for t in query_tokens])
                axis.set_ylabel(f"layer {layer}\n{query_axis}", fontsize=max(font, 8))
            else:
                axis.set_yticks([])
    bar_axis = figure.add_axes(_bar_box(grid, figure, gap_w / width, bar_w / width))
    figure.colorbar(image, cax=bar_axis).set_label("attention weight")
    figure.suptitle(title, fontsize=12, y=1 + 0.6 / height, va="bottom")
    return save_figure(figure, path, dpi)


def _bar_box(grid, figure, gap: float, width: float) -> list[float]:
    """[left, bottom, width, height] of a colour bar in the last grid column (figure fractions)."""
    column = grid[:, -1].get_position(figure)
    return [column.x0 + gap, column.y0, width, column.height]


def number_font(cell_points: float) -> float:
    """The font size (points) at which a printed weight, "0.00" (2.1 em wide in DejaVu Sans), fills
    70 % of a cell ``cell_points`` wide; at most 9 points."""
    return min(9.0, 0.7 * cell_points / 2.1)


def print_weights(axis, values, *, font: float, vmax: float, scale: float = 1.0) -> int:
    """Write each weight of ``values`` (R, C) in its cell, to two decimals; return how many.

    Cell (r, c) is centred at data coordinates ((c + 0.5) scale - 0.5, (r + 0.5) scale - 0.5): an
    ``imshow`` of ``values`` for scale 1, an image of ``scale`` pixels per cell otherwise. A weight
    that prints as 0.00 leaves its cell blank: its colour already says so, and on a peaked or causal
    head most cells are such, so the few large weights stand out and there are fewer texts to draw.
    """
    written = 0
    for row in range(values.shape[0]):
        for column in range(values.shape[1]):
            value = float(values[row, column])
            text = f"{value:.2f}"
            if text == "0.00":
                continue
            # Cell texts sit inside the axes: leaving them out of the layout saves measuring them.
            axis.text((column + 0.5) * scale - 0.5, (row + 0.5) * scale - 0.5, text, ha="center",
                      va="center", fontsize=font,
                      color="black" if value > 0.6 * vmax else "white").set_in_layout(False)
            written += 1
    return written


def head_figure(weights: Tensor, query_tokens: Sequence[str], key_tokens: Sequence[str], *,
                title: str, query_axis: str = "query (attending)",
                key_axis: str = "key (attended to)", print_up_to: int = PRINTED_UP_TO):
    """One head's (T, S) weights, large, as a matplotlib figure (``plot_attention_head`` saves it).

    Up to ``print_up_to`` tokens a side, each weight is printed in its cell (blank where it prints
    as 0.00). A longer head is drawn in colours only, in smaller cells: its numbers would be too
    small to read once the figure is scaled to a screen, and drawing thousands of texts takes
    seconds; the colour bar carries the scale and its label says the numbers are left out.

    Raises:
        ValueError: weights not 2-D, or labels that do not match T / S.
    """
    if weights.dim() != 2:
        raise ValueError(f"head weights must have shape (T, S), got {tuple(weights.shape)}")
    _check_labels(tuple(weights.shape), query_tokens, key_tokens)
    plt = pyplot()
    queries, keys = weights.shape
    values = weights.detach().float().cpu().numpy()
    printed = max(queries, keys) <= print_up_to
    if printed:
        cell = 0.42 if max(queries, keys) <= 24 else 0.34  # inches: room for "0.00"
    else:
        cell = 0.2  # inches: room for a tick label
    figure, axis = plt.subplots(figsize=(cell * keys + 1.2, cell * queries))
    vmax = float(values.max()) if values.size and values.max() > 0 else 1.0
    image = axis.imshow(values, cmap=COLOUR_MAP, vmin=0.0, vmax=vmax, aspect="auto",
                        interpolation="nearest")
    if printed:
        print_weights(axis, values, font=number_font(cell * 72), vmax=vmax)
        scale = "attention weight (blank: 0.00)"
    else:
        scale = f"attention weight (not printed: over {print_up_to} tokens)"
    font = _font_size(cell)
    axis.set_xticks(range(keys))
    axis.set_yticks(range(queries))
    axis.set_xticklabels([display_token(t) for t in key_tokens], rotation=90, fontsize=font)
    axis.set_yticklabels([display_token(t) for t in query_tokens], fontsize=font)
    axis.tick_params(length=0)
    axis.set_xlabel(key_axis)
    axis.set_ylabel(query_axis)
    axis.set_title(title)
    figure.colorbar(image, ax=axis, fraction=0.04, pad=0.02).set_label(scale)
    return figure


def plot_attention_head(weights: Tensor, query_tokens: Sequence[str], key_tokens: Sequence[str],
                        path: str | Path, *, title: str, query_axis: str = "query (attending)",
                        key_axis: str = "key (attended to)", print_up_to: int = PRINTED_UP_TO,
                        dpi: int = 120) -> Path:
    """Draw one head's (T, S) weights large (``head_figure``: weights printed in the cells up to
    ``print_up_to`` tokens a side, colours only beyond) and save the figure to ``path``.

    Raises:
        ValueError: weights not 2-D, labels that do not match T / S, or dpi outside 20..600.
    """
    figure = head_figure(weights, query_tokens, key_tokens, title=title, query_axis=query_axis,
                         key_axis=key_axis, print_up_to=print_up_to)
    return save_figure(figure, path, dpi)
