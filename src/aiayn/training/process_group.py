"""Joining and leaving the process group of a torchrun launch.

Leaving destroys the group for real. ``destroy_process_group()`` only unregisters it: the C++ group
(for gloo: its worker threads and the sockets to the peers) lives while any Python object holds it,
and after a DDP run two kinds do: the failed call's frames (the DDP model, whose reducer holds the
group), kept by the exception's traceback, and the default arguments of
``torch.distributed.nn.functional`` (``group=group.WORLD``, bound when DDP's constructor first
imports that module through ``torch._dynamo``). The group was then destroyed by the interpreter's
shutdown, in a half-finalised interpreter: where a failing rank could abort with SIGABRT
("terminate called without an active exception") instead of exiting with its error, as torch's own
gloo tests did until they destroyed their groups explicitly (pytorch/pytorch#65231).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import traceback
from collections.abc import Iterator
from datetime import timedelta

import torch
from torch import distributed as dist

from aiayn.training.devices import default_device


def world_size_from_env() -> int:
    """WORLD_SIZE set by torchrun (1 when launched as a plain process)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") \
            from None


def rank_device(device: str | None) -> str:
    """The device this rank trains on: "cuda" (or None with a GPU) becomes cuda:LOCAL_RANK."""
    device = default_device(device)
    parsed = torch.device(device)
    if parsed.type == "cuda" and parsed.index is None:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


@contextlib.contextmanager
def process_group_from_env(*, device: str | None, timeout_s: float = 1800.0
                           ) -> Iterator[str | None]:
    """Initialise the default process group from torchrun's environment for the block, and destroy
    it when the block exits, also on an error (so a failing rank never leaves its peers hanging
    longer than ``timeout_s``, and exits with its error instead of aborting).

    Without torchrun (WORLD_SIZE unset or 1) nothing happens and ``device`` is yielded unchanged.
    Otherwise the backend is NCCL for CUDA devices and gloo for the CPU, and the yielded device is
    this rank's (cuda:LOCAL_RANK).

    On leaving, the group is destroyed while the interpreter is whole: on an error the locals of
    the block's finished frames are released (``traceback.clear_frames``; the traceback still
    prints), then the group is unregistered, garbage is collected and the last reference dropped,
    which joins the backend's threads here. Whatever still holds the group keeps it alive: a model
    the caller keeps beyond the block, and under FSDP torch's DTensor caches (no public API
    clears them), so with FSDP the group still ends at the interpreter's shutdown.

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
    # Imported before the group exists, so that its default arguments hold None, not the group.
    importlib.import_module("torch.distributed.nn.functional")
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    try:
        yield device
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)  # the failed call's model and optimizer
        raise
    finally:
        # Older torch ran a gloo group's destructor holding the GIL and can, rarely, hang here
        # (docs/distributed.md); torch releases the GIL there since June 2025.
        dist.destroy_process_group()
        gc.collect()  # reference cycles of the wrapped model
        del group  # the last reference: the group's destructor runs now


def is_rank_zero() -> bool:
    """Whether this process is rank 0 of the process group (or there is no group)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def wait_for_rank_zero() -> None:
    """In a process group, a barrier: the ranks that call this after rank 0 has written files
    (``if is_rank_zero(): write()``) read them complete. No group: nothing. The wait is bounded by
    the group's timeout."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
