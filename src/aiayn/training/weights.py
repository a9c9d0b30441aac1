"""Reading safetensors weights into a model, with clear errors, and averaging checkpoints.

Never a pickle: a file that looks like one is refused with a hint. Tied matrices are stored once
(``unique_tensors``) and assigned to every name that shares them. Writing weights is atomic and
lives in ``checkpoint.py`` with every other file write.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, as hex (run.json and checkpoints record it per file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pickle_hint(path: Path) -> str:
    """" (a pickle ...)" when ``path`` starts like a pickle or a torch.save zip, else ""."""
    with open(path, "rb") as file:
        head = file.read(2)
    if head[:1] == b"\x80" or head == b"PK":
        return ("; it looks like a pickle / torch.save file, which aiayn never loads (it could run "
                "code): convert it to safetensors")
    return ""


def unique_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict with each tied tensor once, under its alphabetically first name
    (the name ``safetensors.torch.save_model`` keeps). Unlike ``save_model`` no map of the dropped
    names goes into the file's metadata: safetensors writes that map in a random order, and the
    same weights must give the same bytes (checksums, bit-identical resume)."""
    groups: dict[tuple, list[str]] = {}
    state = unwrap(model).state_dict()
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tensor.dtype)
        groups.setdefault(key, []).append(name)
    return {min(names): state[min(names)].detach().contiguous() for names in groups.values()}


def read_tensors(path: str | Path, *, sha256: str | None = None) -> dict[str, Tensor]:
    """All tensors of a safetensors file, with clear errors for missing, corrupt or altered files."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if sha256 is not None and sha256_file(path) != sha256:
        raise ValueError(f"{path}: checksum mismatch, the file is corrupt or was modified after "
                         f"it was written")
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error types for bad headers/truncation
        raise ValueError(f"{path}: not a readable safetensors file, corrupt or truncated "
                         f"({error}){pickle_hint(path)}") from None


def load_weights(model: nn.Module, path: str | Path, *, sha256: str | None = None) -> None:
    """Load weights into ``model``; every parameter must be present with its exact shape."""
    tensors = read_tensors(path, sha256=sha256)
    assign_weights(model, tensors, source=str(path))


def assign_weights(model: nn.Module, tensors: Mapping[str, Tensor], *, source: str) -> None:
    """Copy ``tensors`` (safetensors names: tied matrices under one of their names) into ``model``."""
    model = unwrap(model)
    state = model.state_dict(keep_vars=True)
    # Tied parameters appear under several names in state_dict but once in the file.
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        by_storage.setdefault(id(tensor), []).append(name)
    missing, mismatched = [], []
    for names in by_storage.values():
        present = [name for name in names if name in tensors]
        if not present:
            missing.append(names[0])
            continue
        expected = state[names[0]]
        value = tensors[present[0]]
        if tuple(value.shape) != tuple(expected.shape):
            mismatched.append(f"{present[0]}: file {tuple(value.shape)} vs model "
                              f"{tuple(expected.shape)}")
    known = set(state)
    unexpected = sorted(name for name in tensors if name not in known)
    if missing or mismatched or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:5])}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
        if mismatched:
            parts.append(f"shape mismatch {'; '.join(mismatched[:5])}")
        raise ValueError(f"{source}: weights do not match the model config ({'; '.join(parts)})")
    with torch.no_grad():
        for names in by_storage.values():
            name = next(name for name in names if name in tensors)
            state[names[0]].copy_(tensors[name])


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel / compiled wrapper."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def average_checkpoints(paths: Iterable[str | Path]) -> dict[str, Tensor]:
    """The element-wise mean of the weights of several checkpoints (paper 6.1: the last 5).

    Args:
        paths: checkpoint directories (``step-N``) or ``.safetensors`` files.

    Returns:
        A state dict (safetensors names) to load with ``assign_weights`` or save with safetensors.

    Raises:
        ValueError: no paths, or checkpoints with different tensor names or shapes.
    """
    paths = [Path(p) / "model.safetensors" if Path(p).is_dir() else Path(p) for p in paths]
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    total: dict[str, Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for path in paths:
        tensors = read_tensors(path)
        if total and set(tensors) != set(total):
            raise ValueError(f"{path}: tensor names differ from {paths[0]}")
        for name, value in tensors.items():
            if name not in total:
                dtypes[name] = value.dtype
                # Integer buffers (counters) are not averaged: the first checkpoint's value is kept.
                total[name] = value.double() if value.is_floating_point() else value.clone()
            elif value.shape != total[name].shape:
                raise ValueError(f"{path}: {name} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(total[name].shape)}")
            elif value.is_floating_point():
                total[name] += value.double()
    return {name: (value / len(paths)).to(dtypes[name]) if dtypes[name].is_floating_point
            else value for name, value in total.items()}
