"""Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) is running.

The fast paths written as ``torch.autograd.Function``s with in-place forwards (the batched-product
attention, the sigmoid GELU) have no functorch rules, so under a transform the plain PyTorch
operation they stand in for runs instead.
"""

from __future__ import annotations

import torch


def transform_active() -> bool:
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None
