"""The task's training batches as one stream across epochs, with its position (epoch, index in the
epoch) saved in checkpoints: the task's batches are deterministic in (seed, epoch), so a resumed run
skips to the batch it stopped at. Every rank walks the same stream (``Parallel.step_batches``)."""

from __future__ import annotations

import itertools
from typing import Any

from aiayn.training.task import Task


class BatchStream:
    """The task's batches across epochs from a (epoch, index) position."""

    def __init__(self, task: Task, epoch: int, index: int):
        self.task, self.epoch, self.index = task, epoch, index
        self._iterator = itertools.islice(task.train_batches(epoch), index, None)

    def next(self) -> Any:
        for _ in range(2):
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.epoch, self.index = self.epoch + 1, 0
                self._iterator = iter(self.task.train_batches(self.epoch))
                continue
            self.index += 1
            return batch
        raise ValueError(f"task {self.task.name!r} yielded no training batches (epoch "
                         f"{self.epoch}); is the training data empty?")
