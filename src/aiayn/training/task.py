"""The ``Task`` protocol: what the trainer needs to know about a job (translation, lm, ...).

The trainer owns the loop (optimizer, schedule, accumulation, checkpoints, logging); a task owns the
data, the model family, the loss and the validation metrics. Batches are opaque to the trainer except
for ``count`` (loss units, e.g. target tokens) and being movable by the task itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from aiayn.config import TransformerConfig


@runtime_checkable
class Task(Protocol):
    """A training job the engine can run.

    Attributes:
        name: "translation" | "lm" | "classification" | "mlm"; stored in run.json.
    """

    name: str

    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        """The task's adjustments to a preset: vocabulary size and special ids of its tokenizer,
        number of labels, ... Returns the config the model is built from (and saved with the run)."""
        ...

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        """A fresh model of the task's family (e.g. ``Transformer(model_config)``)."""
        ...

    def train_batches(self, epoch: int) -> Iterator[Any]:
        """Training batches of one pass over the data, already on the task's device.

        Must be deterministic given the task's seed and ``epoch`` (use a private
        ``torch.Generator``/``random.Random``, never the global RNG), so that a resumed run can skip
        to the batch it stopped at. May be infinite (then epoch stays 0).
        """
        ...

    def count(self, batch: Any) -> int:
        """Loss units in ``batch`` (e.g. non-pad target tokens), computed on the CPU without a
        device sync: the engine divides the accumulated loss by the sum of counts."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """The SUM of the training loss over the batch's units (a scalar tensor)."""
        ...

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation metrics of ``model`` (called in eval mode under ``torch.no_grad``).

        A task may also define ``metric_names() -> set[str]``, the keys ``evaluate`` returns: the
        trainer then refuses a ``best_metric`` outside them before training, not at the first
        evaluation.
        """
        ...

    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        """Write what inference needs besides the weights (tokenizer, labels) into ``run_dir``;
        return a small JSON-able description stored in run.json under "assets"."""
        ...

    @classmethod
    def load_assets(cls, run_dir: Path) -> Any:
        """Read back what ``save_assets`` wrote (e.g. the tokenizer)."""
        ...
