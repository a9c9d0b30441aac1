"""Checking that every rank trains the same thing: digests of what each rank was given, compared in
one all-gather before anything is written (a rank launched with another config, data or seed would
otherwise silently train a different model, or mix models under FSDP)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import Tensor, nn
from torch import distributed as dist


def check_agreement(parts: dict[str, Any], *, world_size: int, device: torch.device) -> None:
    """Raise on every rank if the ranks disagree on any of ``parts`` (JSON-able values or
    tensors), naming the part and the ranks. One all-gather of 32-byte digests per part, on
    ``device`` (where the backend's collectives run)."""
    names = sorted(parts)
    digests = torch.tensor([list(_digest(parts[name])) for name in names], dtype=torch.uint8,
                           device=device)
    gathered = [torch.empty_like(digests) for _ in range(world_size)]
    dist.all_gather(gathered, digests)
    problems = []
    for row, name in enumerate(names):
        differ = [rank for rank in range(1, world_size)
                  if not torch.equal(gathered[rank][row], gathered[0][row])]
        if differ:
            problems.append(f"{name} (rank(s) {', '.join(map(str, differ))} differ from "
                            f"rank 0)")
    if problems:
        raise ValueError(f"the {world_size} ranks disagree on: {'; '.join(problems)}. "
                         f"Launch every rank with the same command, data and run directory")


def _digest(value: Any) -> bytes:
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.digest()


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, dict):
        hasher.update(b"{")
        for key in sorted(value, key=str):
            hasher.update(str(key).encode())
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (str, int, float, bool, type(None))):
        hasher.update(json.dumps(value).encode())
    elif hasattr(value, "__dict__"):  # a batch object: its fields (never its id-based repr)
        hasher.update(type(value).__qualname__.encode())
        _feed(hasher, vars(value))
    else:
        hasher.update(repr(value).encode())


def data_fingerprint(task: Any, batches: int = 4) -> Any:
    """What identifies a task's training data cheaply: ``task.fingerprint()`` if the task has one,
    else the contents of the first few batches of epoch 0."""
    fingerprint = getattr(task, "fingerprint", None)
    if callable(fingerprint):
        return fingerprint()
    sample = []
    for index, batch in enumerate(task.train_batches(0)):
        if index == batches:
            break
        sample.append(batch)
    return sample


def parameter_fingerprint(module: nn.Module) -> Tensor:
    """Per-parameter float64 sums and sums of squares: equal initial weights on every rank (FSDP
    shards each rank's own copy, so a rank built from another seed would silently mix models)."""
    with torch.no_grad():
        stats = [torch.stack([p.double().sum(), p.double().square().sum()])
                 for p in module.parameters()]
    return torch.stack(stats).cpu() if stats else torch.zeros(0)
