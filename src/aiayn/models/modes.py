"""Running a model for evaluation inside code that does not own its mode (validation during
training, decoding, scoring): eval mode for the block, the caller's mode restored after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) inside the block; its training mode as it was before
    afterwards, also when the block raises."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
