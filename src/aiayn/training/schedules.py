"""Learning-rate schedules as pure functions of the optimizer step.

The trainer calls ``schedule(step)`` with the 1-based number of the update about to be applied, and
writes the value into the optimizer; nothing here holds state, so a resumed run needs only the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ScheduleKind = Literal["noam", "warmup_cosine", "constant"]
SCHEDULE_KINDS = ("noam", "warmup_cosine", "constant")


def noam(step: int, *, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The paper's schedule (section 5.3, equation 3).

    lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5): linear warm-up for ``warmup``
    steps, then decay with the inverse square root of the step. Step 0 is treated as step 1 (the
    formula divides by zero there), as in the Annotated Transformer's ``rate``.
    """
    step = max(int(step), 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def warmup_cosine(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.0) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then a cosine decay to ``floor`` at ``total``.

    Steps past ``total`` stay at ``floor``.
    """
    step = max(int(step), 1)
    if step <= warmup:
        return peak * step / max(warmup, 1)
    if step >= total:
        return floor
    progress = (step - warmup) / max(total - warmup, 1)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass(kw_only=True)
class Schedule:
    """Which schedule and its parameters; calling it gives the learning rate of a step.

    ``noam`` uses ``d_model``, ``warmup`` and ``factor``; ``warmup_cosine`` uses ``peak``, ``warmup``,
    ``total`` and ``floor``; ``constant`` uses ``peak`` (after a linear warm-up of ``warmup`` steps).
    """

    kind: ScheduleKind = "noam"
    d_model: int = 512
    warmup: int = 4000  # paper 5.3
    factor: float = 1.0
    peak: float = 1e-3
    total: int = 100_000
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"schedule kind must be one of {list(SCHEDULE_KINDS)}, got {self.kind!r}")
        for name in ("d_model", "total"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"schedule {name} must be a positive integer, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"schedule warmup must be a non-negative integer, got {self.warmup!r}")
        if self.kind == "noam" and self.warmup == 0:
            raise ValueError("schedule warmup must be positive for the noam schedule")
        for name in ("factor", "peak"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"schedule {name} must be positive, got {value!r}")
        if not isinstance(self.floor, (int, float)) or self.floor < 0:
            raise ValueError(f"schedule floor must be non-negative, got {self.floor!r}")
        if self.kind == "warmup_cosine" and self.floor > self.peak:
            raise ValueError(f"schedule floor {self.floor!r} is above its peak {self.peak!r}: the "
                             f"cosine would climb to it (give a floor at most the peak)")

    def __call__(self, step: int) -> float:
        if self.kind == "noam":
            return noam(step, d_model=self.d_model, warmup=self.warmup, factor=self.factor)
        if self.kind == "warmup_cosine":
            return warmup_cosine(step, peak=self.peak, warmup=self.warmup, total=self.total,
                                 floor=self.floor)
        return self.peak * min(1.0, max(int(step), 1) / self.warmup) if self.warmup else self.peak
