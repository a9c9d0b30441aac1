"""The image classification task: a Vision Transformer, its [CLS] state, a linear classifier.

Images come from ``aiayn.data.images`` as floats in [0, 1] and are standardised per channel with
the training images' mean and std (saved with the run). The loss is the summed cross-entropy over
images (one loss unit per image); validation reports loss, accuracy and macro-F1. Batches are a
fresh permutation of the training images each epoch, drawn from a generator seeded by
(seed, epoch): reproducible and resumable.

Legend: B batch, C channels, H = W image size, K classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.data.images import LabelledImages, channel_statistics, normalise
from aiayn.data.labels import LABELS_FILE, LabelMap
from aiayn.models.vision import ImageClassifier
from aiayn.tasks.classification_metrics import ClassificationReport, classification_report


@dataclass
class ImageBatch:
    """images (B, C, H, W) standardised floats, targets (B,) class indices."""

    images: Tensor
    targets: Tensor

    @property
    def size(self) -> int:
        return self.images.shape[0]


@dataclass
class ImageAssets:
    """What inference needs besides the weights (saved in the run directory).

    Attributes:
        labels: class names in the model's output order.
        mean / std: per-channel statistics of the training images (what ``normalise`` takes).
        data: what the run trained on (``sklearn:digits`` or a folder).
        split: the stratified split of that data (``valid_fraction``, ``test_fraction``,
            ``seed``), so ``aiayn evaluate`` scores the same held-out images.
    """

    labels: LabelMap
    mean: list[float]
    std: list[float]
    data: str | None = None
    split: dict[str, Any] | None = None


class ImageClassificationTask:
    """``aiayn.training.Task`` for image classification with an ``ImageClassifier``.

    Args:
        train / valid: labelled images (labels of both must be in ``labels``).
        labels: the label map (class order of the model).
        batch_size: images per batch.
        seed: batch order seed (with the epoch).
        device: where batches go.
        label_smoothing: cross-entropy smoothing (0: none).
        data / split: stored with the assets (see ``ImageAssets``).
        data_info: described in run.json (image counts).
    """

    name = "image-classification"

    def __init__(self, *, train: LabelledImages, valid: LabelledImages, labels: LabelMap,
                 batch_size: int = 64, seed: int = 0, device: str | torch.device = "cpu",
                 label_smoothing: float = 0.0, data: str | None = None,
                 split: dict[str, Any] | None = None, data_info: dict[str, Any] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if len(train) == 0 or len(valid) == 0:
            raise ValueError(f"image classification needs training and validation images, got "
                             f"{len(train)} and {len(valid)}")
        self.labels, self.batch_size, self.seed = labels, batch_size, seed
        self.device = torch.device(device)
        self.label_smoothing = label_smoothing
        self.data, self.split, self.data_info = data, split, data_info or {}
        self.mean, self.std = channel_statistics(train.images)
        self.train_images = normalise(train.images, self.mean, self.std)  # (N, C, H, W)
        self.train_targets = encode_labels(labels, train)
        self.valid_images = normalise(valid.images, self.mean, self.std)
        self.valid_targets = encode_labels(labels, valid)

    # --- model ----------------------------------------------------------------------------------
    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        """The preset with the number of labels; its image size and channels must be the data's."""
        channels, height, width = self.train_images.shape[1:]
        if (base.num_channels, base.image_size, base.image_size) != (channels, height, width):
            raise ValueError(f"the images are {height}x{width} with {channels} channel(s), the "
                             f"model config takes {base.image_size}x{base.image_size} with "
                             f"{base.num_channels}")
        return base.replace(num_labels=len(self.labels))

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        return ImageClassifier(model_config)

    # --- training -------------------------------------------------------------------------------
    def train_batches(self, epoch: int) -> Iterator[ImageBatch]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.train_targets), generator=generator)
        for rows in order.split(self.batch_size):
            yield ImageBatch(images=self.train_images[rows].to(self.device),
                             targets=self.train_targets[rows].to(self.device))

    def count(self, batch: ImageBatch) -> int:
        return batch.size

    def loss(self, model: nn.Module, batch: ImageBatch) -> Tensor:
        logits = model(batch.images)  # (B, K)
        return nn.functional.cross_entropy(logits.float(), batch.targets, reduction="sum",
                                           label_smoothing=self.label_smoothing)

    def metric_names(self) -> set[str]:
        return {"loss", "accuracy", "macro_f1"}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        probabilities = predict_probabilities(model, self.valid_images, device=self.device)
        loss = nn.functional.nll_loss(probabilities.clamp_min(1e-12).log(), self.valid_targets)
        report = classification_report(self.valid_targets.tolist(),
                                       probabilities.argmax(-1).tolist(), self.labels.names)
        return {"loss": float(loss), "accuracy": report.accuracy, "macro_f1": report.macro_f1}

    # --- assets ---------------------------------------------------------------------------------
    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        self.labels.save(Path(run_dir) / LABELS_FILE)
        return {"labels": LABELS_FILE, "num_labels": len(self.labels), "mean": self.mean,
                "std": self.std, "data": self.data, "split": self.split, **self.data_info}

    @classmethod
    def load_assets(cls, run_dir: Path) -> ImageAssets:
        run_dir = Path(run_dir)
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("assets", {})
        if not isinstance(info.get("mean"), list) or not isinstance(info.get("std"), list):
            raise ValueError(f"{run_dir / 'run.json'}: the image statistics (assets.mean, "
                             f"assets.std) are missing")
        return ImageAssets(labels=LabelMap.load(run_dir / info.get("labels", LABELS_FILE)),
                           mean=info["mean"], std=info["std"], data=info.get("data"),
                           split=info.get("split"))


def encode_labels(labels: LabelMap, data: LabelledImages) -> Tensor:
    """Class indices (N,) of ``data``; an unknown label is an error naming the image."""
    return torch.tensor([labels.index(label, where=source)
                         for label, source in zip(data.labels, data.sources)], dtype=torch.long)


@torch.no_grad()
def predict_probabilities(model: nn.Module, images: Tensor, *, device: str | torch.device = "cpu",
                          batch_size: int = 256) -> Tensor:
    """Class probabilities (N, K) of standardised images (N, C, H, W), float32 on the CPU.

    The model is used as it is (call ``model.eval()`` first for inference).
    """
    if len(images) == 0:
        raise ValueError("no images to classify")
    chunks = [model(chunk.to(device)).float().softmax(-1).cpu()  # (B, K)
              for chunk in images.split(batch_size)]
    return torch.cat(chunks)


def score(model: nn.Module, assets: ImageAssets, data: LabelledImages, *,
          device: str | torch.device = "cpu") -> tuple[ClassificationReport, Tensor]:
    """Metrics of ``model`` on labelled images and the probabilities (N, K).

    Raises:
        ValueError: a label the model does not know (the image named).
    """
    targets = encode_labels(assets.labels, data)
    probabilities = predict_probabilities(model, normalise(data.images, assets.mean, assets.std),
                                          device=device)
    return (classification_report(targets.tolist(), probabilities.argmax(-1).tolist(),
                                  assets.labels.names), probabilities)
