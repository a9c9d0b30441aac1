"""Where a Vision Transformer looks: the [CLS] token's attention over the patches, on the image.

- per head: row 0 of a layer's weights (what [CLS] attends to), keys 1..N laid out as the G x G
  patch grid, so each patch's weight covers its P x P pixels of the image;
- attention rollout (Abnar & Zuidema 2020; the ViT paper's appendix D.8 draws its Figure 6 with
  it): per layer the weights averaged over heads plus the identity for the residual connection,
  0.5 A + 0.5 I (rows still sum to 1), multiplied through the layers; row 0 after layer l is how
  much of each patch's input has reached [CLS] by then, attention on attention included.

The weights come from the model's ``return_attention=True`` path (data, not hooks). matplotlib is
imported inside the plotting functions (Agg backend).

Legend: L layers, H heads, T = 1 + N tokens ([CLS] first), N = G^2 patches, C channels, S = W
image size in pixels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from aiayn.visualise.files import atomic_write_text
from aiayn.visualise.heatmaps import number_font, print_weights, pyplot, save_figure

OVERLAY_MAP = "inferno"
MIN_NUMBER_FONT = 5.0  # points: smaller printed weights cannot be read at the default 110 dpi


def _patch_grid(rows: Tensor) -> Tensor:
    """Weights (..., T) on [CLS] + N patches -> (..., G, G) on the patches alone."""
    patches = rows[..., 1:]  # (..., N): [CLS]'s own weight is left out of the picture
    grid = int(round(patches.shape[-1] ** 0.5))
    if grid * grid != patches.shape[-1]:
        raise ValueError(f"{patches.shape[-1]} patches do not form a square grid")
    return patches.reshape(*patches.shape[:-1], grid, grid)  # (..., G, G), row-major patches


def cls_attention(weights: Tensor) -> Tensor:
    """(L, H, T, T) weights of one image -> (L, H, G, G): what [CLS] attends to, per head."""
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must have shape (L, H, T, T), got {tuple(weights.shape)}")
    return _patch_grid(weights[:, :, 0, :])


def attention_rollout(weights: Tensor) -> Tensor:
    """(L, H, T, T) weights of one image -> (L, G, G): [CLS]'s rollout after each layer."""
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must have shape (L, H, T, T), got {tuple(weights.shape)}")
    tokens = weights.shape[-1]
    identity = torch.eye(tokens, dtype=torch.float64)
    rollout = identity
    rows = []
    for layer in weights.double():  # (H, T, T)
        mixed = 0.5 * layer.mean(0) + 0.5 * identity  # (T, T): attention + the residual path
        mixed = mixed / mixed.sum(-1, keepdim=True)
        rollout = mixed @ rollout
        rows.append(rollout[0])
    return _patch_grid(torch.stack(rows)).float()  # (L, G, G)


def _show_image(axis, image: Tensor) -> None:
    """An image (C, S, S) in [0, 1]: grey for 1-2 channels, RGB for 3-4 (alpha dropped)."""
    pixels = image.detach().float().clamp(0, 1).cpu()
    if pixels.shape[0] >= 3:
        axis.imshow(pixels[:3].permute(1, 2, 0).numpy(), interpolation="nearest")  # (S, S, 3)
    else:
        axis.imshow(pixels[0].numpy(), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    axis.set_xticks([])
    axis.set_yticks([])


def _overlay(axis, image: Tensor, grid: Tensor, title: str, alpha: float) -> None:
    """The image with a (G, G) patch map over it, one coloured square per patch."""
    _show_image(axis, image)
    size = image.shape[-1]
    values = grid.detach().float().cpu().numpy()
    top = float(values.max()) if values.max() > 0 else 1.0
    axis.imshow(values, cmap=OVERLAY_MAP, alpha=alpha, vmin=0.0, vmax=top,
                interpolation="nearest", extent=(-0.5, size - 0.5, size - 0.5, -0.5))
    axis.set_title(f"{title}\nmax {top:.2f}", fontsize=8, pad=2)


def plot_cls_attention(image: Tensor, cls: Tensor, path: str | Path, *, title: str,
                       alpha: float = 0.6, dpi: int = 110) -> Path:
    """Layers x (heads + their mean) panels of [CLS]'s attention ``cls`` (L, H, G, G) over the
    ``image`` (C, S, S); each panel on its own scale (its maximum in its title)."""
    plt = pyplot()
    layers, heads = cls.shape[:2]
    figure, axes = plt.subplots(layers, heads + 1, figsize=(1.5 * (heads + 1), 1.7 * layers),
                                squeeze=False)
    for layer in range(layers):
        for head in range(heads):
            _overlay(axes[layer][head], image, cls[layer, head], f"L{layer} H{head}", alpha)
        _overlay(axes[layer][heads], image, cls[layer].mean(0), f"L{layer} mean", alpha)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return save_figure(figure, path, dpi)


def patch_map_figure(image: Tensor, grid: Tensor, *, title: str, alpha: float = 0.6):
    """One (G, G) patch map over the image, large, as a matplotlib figure (``plot_patch_map``
    saves it).

    Each patch's weight is written on it, in the largest font (at most 9 points) that fits the
    patch, while that font is at least ``MIN_NUMBER_FONT`` points: up to 20 x 20 patches (ViT-B/16
    and ViT-L/14 at 224 pixels are 14 x 14 and 16 x 16). Weights that print as 0.00 are left blank,
    so the image shows through where [CLS] does not look. A finer grid is drawn in colours only,
    and its title says so.
    """
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(4.5, 4.8))
    _overlay(axis, image, grid, title, alpha)
    figure.tight_layout()  # before the numbers: their font follows the laid-out patch size
    size, cells = image.shape[-1], grid.shape[-1]
    font = number_font(axis.get_position().width * figure.get_figwidth() * 72 / cells)
    if font >= MIN_NUMBER_FONT:
        values = grid.detach().float().cpu()
        top = float(values.max()) if values.max() > 0 else 1.0
        print_weights(axis, values, font=font, vmax=top, scale=size / cells)
    else:
        axis.set_title(f"{axis.get_title()}, weights not printed ({cells} x {cells} patches)",
                       fontsize=8, pad=2)
    return figure


def plot_patch_map(image: Tensor, grid: Tensor, path: str | Path, *, title: str,
                   alpha: float = 0.6, dpi: int = 110) -> Path:
    """Draw one (G, G) patch map over the image large (``patch_map_figure``: weights written on
    the patches up to 20 x 20 of them) and save it to ``path``."""
    return save_figure(patch_map_figure(image, grid, title=title, alpha=alpha), path, dpi)


def plot_rollout(image: Tensor, rollout: Tensor, path: str | Path, *, title: str,
                 alpha: float = 0.6, dpi: int = 110) -> Path:
    """The image, then [CLS]'s attention rollout (L, G, G) after each layer over it."""
    plt = pyplot()
    layers = rollout.shape[0]
    figure, axes = plt.subplots(1, layers + 1, figsize=(1.6 * (layers + 1), 2.0), squeeze=False)
    _show_image(axes[0][0], image)
    axes[0][0].set_title("image", fontsize=8, pad=2)
    for layer in range(layers):
        _overlay(axes[0][layer + 1], image, rollout[layer], f"rollout to L{layer}", alpha)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return save_figure(figure, path, dpi)


@dataclass
class ImageAttention:
    """One image's attention as data: ``cls`` (L, H, G, G) per head, ``rollout`` (L, G, G), and
    the class probabilities (K,) of a classifier (None for a bare ``VisionTransformer``)."""

    cls: Tensor
    rollout: Tensor
    probabilities: Tensor | None


@torch.inference_mode()
def image_attention(model: nn.Module, model_input: Tensor) -> ImageAttention:
    """Run ``model`` (an ``ImageClassifier`` or ``VisionTransformer``) on one image (C, S, S), as
    the model reads it (e.g. standardised), and return where its [CLS] token looks."""
    output, maps = model(model_input.unsqueeze(0), return_attention=True)  # (1, C, S, S) in
    weights = torch.stack([w[0] for w in maps.encoder]).float().cpu()  # (L, H, T, T)
    probabilities = output[0].float().softmax(-1).cpu() if output.dim() == 2 else None  # (K,)
    return ImageAttention(cls_attention(weights), attention_rollout(weights), probabilities)


def write_image_attention_report(attention: ImageAttention, image: Tensor, out_dir: str | Path,
                                 *, labels: tuple[str, ...] | None = None,
                                 layer: int | None = None, head: int | None = None,
                                 title: str = "attention", dpi: int = 110) -> dict[str, Path]:
    """Draw ``attention`` over ``image`` (C, S, S) in [0, 1] into ``out_dir``; return the files.

    Files: ``cls_attention.png`` (every layer and head, and their mean), ``cls_L<l>_H<h>.png`` (one
    head large, the weights written on the patches up to 20 x 20 of them; default the last layer's
    head 0), ``rollout.png``, and ``attention.json`` (the maps as numbers and, with ``labels``,
    the prediction).

    Raises:
        ValueError: a layer or head the model does not have.
    """
    cls, rollout = attention.cls, attention.rollout
    layers, heads = cls.shape[:2]
    layer = layers - 1 if layer is None else layer
    head = 0 if head is None else head
    if not 0 <= layer < layers:
        raise ValueError(f"--layer {layer}: the model has layers 0..{layers - 1}")
    if not 0 <= head < heads:
        raise ValueError(f"--head {head}: the model has heads 0..{heads - 1}")
    out_dir = Path(out_dir)
    written = {
        "cls_attention": plot_cls_attention(image, cls, out_dir / "cls_attention.png",
                                            title=f"{title}: [CLS] attention per head", dpi=dpi),
        f"cls_L{layer}_H{head}": plot_patch_map(
            image, cls[layer, head], out_dir / f"cls_L{layer}_H{head}.png",
            title=f"{title}: [CLS] attention, layer {layer} head {head}", dpi=dpi),
        "rollout": plot_rollout(image, rollout, out_dir / "rollout.png",
                                title=f"{title}: attention rollout", dpi=dpi)}
    report: dict = {"cls_attention": cls.tolist(), "rollout": rollout.tolist()}
    if attention.probabilities is not None:
        names = labels or tuple(str(i) for i in range(len(attention.probabilities)))
        report["probabilities"] = dict(zip(names, attention.probabilities.tolist()))
    atomic_write_text(out_dir / "attention.json", json.dumps(report) + "\n")
    written["attention.json"] = out_dir / "attention.json"
    return written
