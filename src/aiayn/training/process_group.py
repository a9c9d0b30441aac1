"""Joining and leaving the process group of a torchrun launch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
from torch import distributed as dist


def world_size_from_env() -> int:
    """WORLD_SIZE set by torchrun (1 when launched as a plain process)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") \
            from None


def rank_device(device: str | None) -> str:
    """The device this rank trains on: "cuda" (or None with a GPU) becomes cuda:LOCAL_RANK."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    parsed = torch.device(device)
    if parsed.type == "cuda" and parsed.index is None:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


@contextlib.contextmanager
def process_group_from_env(*, device: str | None, timeout_s: float = 1800.0
                           ) -> Iterator[str | None]:
    """Initialise the default process group from torchrun's environment for the block, and destroy
    it when the block exits, also on an error (so a failing rank never leaves its peers hanging
    longer than ``timeout_s``).

    Without torchrun (WORLD_SIZE unset or 1) nothing happens and ``device`` is yielded unchanged.
    Otherwise the backend is NCCL for CUDA devices and gloo for the CPU, and the yielded device is
    this rank's (cuda:LOCAL_RANK).

    Args:
        device: "cpu", "cuda", "cuda:1", ... or None (cuda if available).
        timeout_s: how long a collective waits for a missing rank before failing.

    Raises:
        ValueError: a non-positive timeout or a malformed torchrun environment.
        RuntimeError: torch.distributed is not available in this build.
    """
    if not timeout_s > 0:
        raise ValueError(f"the process group timeout must be positive, got {timeout_s!r}")
    if world_size_from_env() <= 1 or (dist.is_available() and dist.is_initialized()):
        yield device
        return
    if not dist.is_available():
        raise RuntimeError("this PyTorch build has no torch.distributed; install one that has it")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"WORLD_SIZE is set but {name} is not: launch with torchrun")
    device = rank_device(device)
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield device
    finally:
        dist.destroy_process_group()
