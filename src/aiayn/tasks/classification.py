"""The text classification task: an encoder, a pooled representation, a linear classifier.

Data is a labelled TSV (``aiayn.data.labelled_tsv``); rows are tokenised once into
``[CLS] pieces [SEP]`` ids, batched by similar length, and the loss is the summed cross-entropy over
examples (one loss unit per example). Validation reports loss, accuracy and macro-F1; the run keeps
the best macro-F1 checkpoint by default.

Legend: B batch, T longest length in the batch, C classes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.data.sequence_batches import bucketed_batches, pad_right
from aiayn.data.labelled_tsv import LabelledTexts
from aiayn.data.labels import LABELS_FILE, LabelMap
from aiayn.data.wordpiece import TOKENIZER_FILE, WordPieceTokenizer
from aiayn.models.encoder_only import SequenceClassifier
from aiayn.nn.attention.kernels import swap_exact_kernels
from aiayn.tasks.classification_metrics import ClassificationReport, classification_report
from aiayn.tasks.pretrained import PretrainedEncoder


@dataclass
class ClassificationBatch:
    """ids (B, T), padding_mask (B, T) True = real token, targets (B,) class indices."""

    ids: Tensor
    padding_mask: Tensor
    targets: Tensor

    @property
    def size(self) -> int:
        return self.ids.shape[0]


@dataclass
class ClassificationAssets:
    """What inference needs besides the weights (saved in the run directory).

    Attributes:
        tokenizer / labels: as trained.
        max_tokens: sequences are cut to this many ids, ``[CLS]`` and ``[SEP]`` included.
        split: how the training file was split (``valid_fraction``, ``test_fraction``, ``seed``),
            so ``aiayn evaluate`` can score the same test rows; None when the file had a split
            column.
    """

    tokenizer: WordPieceTokenizer
    labels: LabelMap
    max_tokens: int
    split: dict[str, Any] | None = None


class ClassificationTask:
    """``aiayn.training.Task`` for sequence classification.

    Args:
        train / valid: labelled rows (labels of both must be in ``labels``).
        labels: the label map (class order of the model).
        tokenizer: turns texts into ids.
        max_tokens: ids per sequence at most.
        batch_size: examples per batch.
        seed: batch order seed (with the epoch).
        device: where batches go.
        label_smoothing: cross-entropy smoothing (0: none).
        split: stored with the assets (see ``ClassificationAssets``).
        pretrained: an encoder to start from (its config replaces the preset's architecture).
        pooling: "first" or "mean" (overrides the config's).
        trainable_layers: train only the top this many encoder layers and the head; the embeddings
            and the layers below keep their (pretrained) weights, and the backward pass stops
            above them; "layers": every layer and the head, the embeddings stay (None: train
            everything).
        data_info: described in run.json (data file, row counts).
        training_attention: train with this exact attention kernel ("reference" or "fused") in
            place of the config's (``swap_exact_kernels``: the same model, another speed); the
            run's config, and so inference, keeps the config's kernel. None: no swap.
    """

    name = "classification"

    def __init__(self, *, train: LabelledTexts, valid: LabelledTexts, labels: LabelMap,
                 tokenizer: WordPieceTokenizer, max_tokens: int = 128, batch_size: int = 32,
                 seed: int = 0, device: str | torch.device = "cpu", label_smoothing: float = 0.0,
                 split: dict[str, Any] | None = None, pretrained: PretrainedEncoder | None = None,
                 pooling: str = "mean", data_info: dict[str, Any] | None = None,
                 trainable_layers: int | str | None = None,
                 training_attention: str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if len(train) == 0 or len(valid) == 0:
            raise ValueError(f"classification needs training and validation rows, got "
                             f"{len(train)} and {len(valid)}")
        self.labels, self.tokenizer = labels, tokenizer
        self.max_tokens, self.batch_size, self.seed = max_tokens, batch_size, seed
        self.device = torch.device(device)
        self.label_smoothing = label_smoothing
        self.split, self.pretrained, self.pooling = split, pretrained, pooling
        if trainable_layers is not None and trainable_layers != "layers" and not (
                isinstance(trainable_layers, int) and trainable_layers >= 0):
            raise ValueError(f"trainable_layers must be a count >= 0, 'layers' or None, got "
                             f"{trainable_layers!r}")
        self.trainable_layers = trainable_layers
        self.training_attention = training_attention
        self.data_info = data_info or {}
        self.train_ids = tokenizer.encode(train.texts, max_length=max_tokens)
        self.train_targets = encode_labels(labels, train)
        self.valid_ids = tokenizer.encode(valid.texts, max_length=max_tokens)
        self.valid_targets = encode_labels(labels, valid)

    # --- model ----------------------------------------------------------------------------------
    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        """The preset with this tokenizer's vocabulary and pad id, the labels and the pooling;
        with a pretrained encoder, its architecture instead of the preset's."""
        if self.pretrained is not None:
            config = self.pretrained.config
            limit = config.position_limit  # None: any length (DeBERTa-v3)
            if limit is not None and self.max_tokens > limit:
                raise ValueError(f"max_tokens {self.max_tokens} exceeds the pretrained encoder's "
                                 f"{limit} positions (lower --max-tokens)")
            return config.replace(num_labels=len(self.labels), pooling=self.pooling)
        # src_vocab_size=None: re-derived from vocab_size (replace keeps the preset's otherwise)
        return base.replace(vocab_size=self.tokenizer.vocab_size, src_vocab_size=None,
                            pad_id=self.tokenizer.pad_id,
                            num_labels=len(self.labels), pooling=self.pooling,
                            max_length=max(base.max_length, self.max_tokens))

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        model = SequenceClassifier(model_config)
        if self.pretrained is not None:
            model.encoder.load_state_dict(self.pretrained.weights)
        if self.trainable_layers is not None:
            stack = model.encoder.encoder
            count = (len(stack.layers) if self.trainable_layers == "layers"
                     else self.trainable_layers)
            if count > len(stack.layers):
                raise ValueError(f"cannot train the top {count} layers of an encoder of "
                                 f"{len(stack.layers)}")
            for module in [stack.embeddings, *stack.layers[:len(stack.layers) - count]]:
                module.requires_grad_(False)
        if self.training_attention is not None:
            swap_exact_kernels(model, self.training_attention)
        return model

    # --- training -------------------------------------------------------------------------------
    def train_batches(self, epoch: int) -> Iterator[ClassificationBatch]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        lengths = [len(ids) for ids in self.train_ids]
        for rows in bucketed_batches(lengths, batch_size=self.batch_size, rng=rng):
            yield self._batch([self.train_ids[i] for i in rows],
                              [self.train_targets[i] for i in rows])

    def _batch(self, sequences: Sequence[Sequence[int]], targets: Sequence[int]
               ) -> ClassificationBatch:
        ids, mask = pad_right(sequences, self.tokenizer.pad_id)
        return ClassificationBatch(ids=ids.to(self.device), padding_mask=mask.to(self.device),
                                   targets=torch.as_tensor(targets).to(self.device))

    def count(self, batch: ClassificationBatch) -> int:
        return batch.size

    def loss(self, model: nn.Module, batch: ClassificationBatch) -> Tensor:
        logits = model(batch.ids, padding_mask=batch.padding_mask)  # (B, C)
        return nn.functional.cross_entropy(logits.float(), batch.targets, reduction="sum",
                                           label_smoothing=self.label_smoothing)

    def metric_names(self) -> set[str]:
        return {"loss", "accuracy", "macro_f1"}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        probabilities = predict_probabilities(model, self.valid_ids, pad_id=self.tokenizer.pad_id,
                                              device=self.device)
        targets = torch.as_tensor(self.valid_targets)
        loss = nn.functional.nll_loss(probabilities.clamp_min(1e-12).log(), targets)
        report = classification_report(self.valid_targets, probabilities.argmax(-1).tolist(),
                                       self.labels.names)
        return {"loss": float(loss), "accuracy": report.accuracy, "macro_f1": report.macro_f1}

    # --- assets ---------------------------------------------------------------------------------
    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        run_dir = Path(run_dir)
        self.tokenizer.save(run_dir / TOKENIZER_FILE)
        self.labels.save(run_dir / LABELS_FILE)
        return {"tokenizer": TOKENIZER_FILE, "labels": LABELS_FILE, "max_tokens": self.max_tokens,
                "num_labels": len(self.labels), "split": self.split,
                "init": self.pretrained.source if self.pretrained else None, **self.data_info}

    @classmethod
    def load_assets(cls, run_dir: Path) -> ClassificationAssets:
        run_dir = Path(run_dir)
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("assets", {})
        return ClassificationAssets(
            tokenizer=WordPieceTokenizer.load(run_dir / info.get("tokenizer", TOKENIZER_FILE)),
            labels=LabelMap.load(run_dir / info.get("labels", LABELS_FILE)),
            max_tokens=int(info.get("max_tokens", 128)), split=info.get("split"))


def encode_labels(labels: LabelMap, rows: LabelledTexts) -> list[int]:
    """Class indices of ``rows``; an unknown label is an error naming the file and line."""
    return [labels.index(label, where=f"{rows.source}:{line}")
            for label, line in zip(rows.labels, rows.lines)]


@torch.no_grad()
def predict_probabilities(model: nn.Module, sequences: Sequence[Sequence[int]], *, pad_id: int,
                          device: str | torch.device = "cpu", tokens_per_batch: int = 8192
                          ) -> Tensor:
    """Class probabilities (N, C) of id sequences, in input order (float32, on the CPU).

    Batches hold about ``tokens_per_batch`` padded positions; rows are sorted by length so that
    padding stays small. The model is used as it is (call ``model.eval()`` first for inference).
    """
    if not sequences:
        raise ValueError("nothing to classify")
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches: list[list[int]] = [[]]
    for index in order:  # ascending lengths: the newest row is the batch's longest
        if batches[-1] and (len(batches[-1]) + 1) * len(sequences[index]) > tokens_per_batch:
            batches.append([])
        batches[-1].append(index)
    results: list[Tensor | None] = [None] * len(sequences)
    for rows in batches:
        ids, mask = pad_right([sequences[i] for i in rows], pad_id)
        logits = model(ids.to(device), padding_mask=mask.to(device))  # (B, C)
        probabilities = logits.float().softmax(-1).cpu()
        for row, index in enumerate(rows):
            results[index] = probabilities[row]
    return torch.stack(results)  # type: ignore[arg-type]


def score(model: nn.Module, assets: ClassificationAssets, rows: LabelledTexts, *,
          device: str | torch.device = "cpu", tokens_per_batch: int = 8192
          ) -> tuple[ClassificationReport, Tensor]:
    """Metrics of ``model`` on labelled ``rows`` and the probabilities (N, C).

    Raises:
        ValueError: a label the model does not know (file and line named).
    """
    targets = encode_labels(assets.labels, rows)
    sequences = assets.tokenizer.encode(rows.texts, max_length=assets.max_tokens)
    probabilities = predict_probabilities(model, sequences, pad_id=assets.tokenizer.pad_id,
                                          device=device, tokens_per_batch=tokens_per_batch)
    return (classification_report(targets, probabilities.argmax(-1).tolist(),
                                  assets.labels.names), probabilities)
