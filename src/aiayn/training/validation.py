"""Validation inside a training run: metrics computed without disturbing the training RNG streams (so
a run that evaluates resumes exactly), and which metric value is the better one."""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.models.modes import evaluating
from aiayn.training.task import Task


def is_better(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` beats ``best`` ("min" or "max"); a finite value beats no or a non-finite
    best."""
    if best is None or not math.isfinite(best):
        return math.isfinite(value)
    return value < best if mode == "min" else value > best


def check_best_metric(task: Task, metric: str | None) -> None:
    """Raise ValueError if ``task`` declares its metrics (``metric_names``) and ``metric`` is not
    one of them: before training, not at the first evaluation."""
    names = task.metric_names() if hasattr(task, "metric_names") else None
    if metric is not None and names is not None and metric not in names:
        raise ValueError(f"best_metric {metric!r} is not among the task's metrics {sorted(names)}")


def evaluate_model(model: nn.Module, task: Task, best_metric: str | None = None
                   ) -> dict[str, float]:
    """Validation metrics, without disturbing the training RNG streams (exact resume); those of a
    task that declares them (``metric_names``) are checked against the declaration, and
    ``best_metric`` must be among them."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else []
    with evaluating(model), torch.random.fork_rng(devices=devices), torch.no_grad():
        metrics = {key: float(value) for key, value in task.evaluate(model).items()}
    if hasattr(task, "metric_names") and set(metrics) != task.metric_names():
        raise RuntimeError(f"task {task.name!r} reported {sorted(metrics)} but declares "
                           f"{sorted(task.metric_names())} (metric_names)")
    if best_metric is not None and best_metric not in metrics:
        raise ValueError(f"best_metric {best_metric!r} is not among the task's metrics "
                         f"{sorted(metrics)}")
    return metrics
