"""Labelled images: scikit-learn's handwritten digits, or a folder with one sub-folder per class.

- ``sklearn:digits``: ``sklearn.datasets.load_digits``, bundled with scikit-learn (offline): 1,797
  real 8 x 8 grey images of the digits 0-9 (UCI's optdigits test set), pixel values 0..16.
- a folder ``DIR/<class>/<image>``: every image file (by suffix) in each class sub-folder, read with
  Pillow, converted to the model's channels (1 grey, 2 grey + alpha, 3 RGB, 4 RGBA) and resized to
  the model's square size (bilinear) when it differs. Hidden entries and files beside the class
  folders are skipped; other files inside a class folder are skipped too (not images by name).

Pixels come back as floats in [0, 1]; ``channel_statistics`` / ``normalise`` standardise each
channel with the training images' mean and std, which the run saves, so that evaluation and
``aiayn attention`` see what training saw. Splits are ``aiayn.data.splits.stratified_split``:
deterministic, every class in every part. Errors are ``path: message``.

Legend: N images, C channels, H = W image size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

DIGITS = "sklearn:digits"
# The digits' fixed split: 70 / 10 / 20 per class, seed 0 (docs/vision.md reports on its test part).
DIGITS_SPLIT = {"valid_fraction": 0.1, "test_fraction": 0.2, "seed": 0}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm",
                  ".pgm")
PILLOW_MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # channels -> the mode images convert to


@dataclass(frozen=True)
class LabelledImages:
    """Images (N, C, H, W) float32 in [0, 1], a label per image, and where each image came from."""

    images: Tensor
    labels: tuple[str, ...]
    sources: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: list[int] | tuple[int, ...]) -> "LabelledImages":
        """The images at ``indices`` (in that order)."""
        rows = torch.as_tensor(list(indices), dtype=torch.long)
        return LabelledImages(self.images[rows], tuple(self.labels[i] for i in indices),
                              tuple(self.sources[i] for i in indices), self.source)


def load_digits() -> LabelledImages:
    """scikit-learn's 1,797 digits as (1797, 1, 8, 8) floats in [0, 1] (raw values / 16)."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N,1,8,8)
    labels = tuple(str(int(target)) for target in digits.target)
    return LabelledImages(images, labels, tuple(f"{DIGITS}[{i}]" for i in range(len(labels))),
                          DIGITS)


def read_image(path: str | Path, *, image_size: int, channels: int) -> Tensor:
    """One image file as (C, image_size, image_size) floats in [0, 1].

    Raises:
        FileNotFoundError: no such file.
        ValueError: a file Pillow cannot read, or a number of channels no Pillow mode has.
    """
    from PIL import Image, UnidentifiedImageError

    import numpy as np

    path = Path(path)
    if channels not in PILLOW_MODES:
        raise ValueError(f"{path}: images with {channels} channels are not supported (1, 2, 3 "
                         f"or 4)")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such image file")
    try:
        with Image.open(path) as image:
            image = image.convert(PILLOW_MODES[channels])
            if image.size != (image_size, image_size):
                image = image.resize((image_size, image_size), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, dtype=np.float32) / 255.0  # (H, W) or (H, W, C)
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ValueError(f"{path}: not an image Pillow can read ({error})") from None
    tensor = torch.from_numpy(pixels.copy())
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1)  # (C, H, W)


def read_image_folder(path: str | Path, *, image_size: int, channels: int) -> LabelledImages:
    """Every image under ``path/<class>/`` (its sub-folders included, as torchvision's
    ``ImageFolder`` reads them; hidden files and folders left out), labelled by the class folder's
    name, in sorted order.

    Raises:
        FileNotFoundError / NotADirectoryError: ``path`` missing or a file.
        ValueError: no class folders, a class folder without images, an unreadable image.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such image folder")
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a folder (expected one sub-folder of images per "
                                 f"class)")
    classes = sorted(entry for entry in root.iterdir()
                     if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise ValueError(f"{root}: no class folders (expected {root}/<class>/<image>)")
    images, labels, sources = [], [], []
    for folder in classes:
        files = sorted(entry for entry in folder.rglob("*") if entry.is_file()
                       and not any(part.startswith(".")
                                   for part in entry.relative_to(folder).parts)
                       and entry.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"{folder}: no images (looked for {', '.join(IMAGE_SUFFIXES)})")
        for file in files:
            images.append(read_image(file, image_size=image_size, channels=channels))
            labels.append(folder.name)
            sources.append(str(file))
    return LabelledImages(torch.stack(images), tuple(labels), tuple(sources), str(root))


def load_images(data: str, *, image_size: int, channels: int) -> LabelledImages:
    """``sklearn:digits`` or a folder of class sub-folders (see the module docstring).

    Raises:
        ValueError: the digits asked for at another size or channel count than 8 x 8 grey; see
            ``read_image_folder``.
    """
    if data != DIGITS:
        return read_image_folder(data, image_size=image_size, channels=channels)
    if (image_size, channels) != (8, 1):
        raise ValueError(f"{DIGITS} are 8x8 grey images; the model takes {image_size}x{image_size} "
                         f"with {channels} channel(s) (set image_size=8, num_channels=1)")
    return load_digits()


def split_images(data: LabelledImages, *, valid_fraction: float, test_fraction: float,
                 seed: int) -> dict[str, LabelledImages]:
    """The stratified train / valid / test parts of ``data`` (``aiayn.data.splits``)."""
    from aiayn.data.splits import stratified_split

    parts = stratified_split(list(data.labels), valid_fraction=valid_fraction,
                             test_fraction=test_fraction, seed=seed)
    return {name: data.subset(parts.part(name)) for name in ("train", "valid", "test")}


def channel_statistics(images: Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of images (N, C, H, W) (a constant channel gets std 1)."""
    flat = images.transpose(0, 1).reshape(images.shape[1], -1).double()  # (C, N H W)
    std = flat.std(dim=1)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return flat.mean(dim=1).tolist(), std.tolist()


def normalise(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """(images - mean) / std per channel; images (N, C, H, W) or (C, H, W)."""
    shape = (-1, 1, 1)  # (C, 1, 1): broadcast over the pixels
    mean_t = torch.tensor(mean, dtype=images.dtype).view(shape)
    std_t = torch.tensor(std, dtype=images.dtype).view(shape)
    return (images - mean_t) / std_t
