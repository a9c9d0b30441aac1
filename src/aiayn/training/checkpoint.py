"""Atomic, pickle-free checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint directory ``checkpoints/step-N/`` holds ``model.safetensors`` (weights),
``trainer_state.safetensors`` (optimizer moments, RNG states) and ``trainer_state.json`` (step, data
position, optimizer hyper-parameters, best metric, SHA-256 of both tensor files). It is written into a
temporary sibling directory and renamed into place, so a crash mid-write never leaves a half-written
``step-N`` and never touches the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

CHECKPOINT_PREFIX = "step-"
TEMP_SUFFIX = ".tmp"  # every temporary file or directory written here: ".<final name>.<random>.tmp"

# errno values that mean "no room" or "not allowed to write here", with the hint the error gives.
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


# --- write errors -------------------------------------------------------------------------------
def _is_write_error(error: BaseException) -> bool:
    # safetensors' Rust writer raises its own SafetensorError ("I/O error: ... (os error 28)").
    return isinstance(error, OSError) or type(error).__name__ == "SafetensorError"


class WriteError(OSError):
    """A failed write (``errno`` kept) whose message names the path, the reason, and that nothing
    was lost; ``str()`` is that message alone (no "[Errno N]" prefix)."""

    def __str__(self) -> str:
        return str(self.strerror if self.errno is not None else super().__str__())


def _write_error(error: BaseException, path: Path, what: str) -> OSError:
    """An OSError that names what could not be written, where, why, and what is left intact."""
    code = getattr(error, "errno", None)
    if code is None:
        match = re.search(r"os error (\d+)", str(error))
        code = int(match.group(1)) if match else None
    reason = (getattr(error, "strerror", None) if isinstance(error, OSError) else None) \
        or (os.strerror(code) if code else None) or str(error)
    hint = " (disk full?)" if code in _FULL else \
        " (read-only or not writable directory?)" if code in _READ_ONLY else ""
    message = (f"cannot write {what} {path}: {reason}{hint}; nothing was half-written and the "
               f"previous files are intact")
    return WriteError(code, message) if code is not None else WriteError(message)


@contextlib.contextmanager
def explain_write_errors(path: str | Path, what: str) -> Iterator[None]:
    """Turn an OSError / SafetensorError raised while writing ``path`` into one clear OSError."""
    try:
        yield
    except Exception as error:
        # An inner writer's explained error is re-explained with this (outer, final) path.
        original = error.__cause__ if getattr(error, "_aiayn_explained", False) else error
        if original is not None and _is_write_error(original):
            explained = _write_error(original, Path(path), what)
            explained._aiayn_explained = True  # type: ignore[attr-defined]
            raise explained from original
        raise


# --- atomic file primitives ---------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # directories cannot be opened on some platforms
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync, rename.

    Raises:
        OSError: the write failed (disk full, read-only directory, ...); the message names
            ``path`` and the reason, ``path`` keeps its previous content and no temporary is left.
    """
    path = Path(path)
    with explain_write_errors(path, "file"):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- weights ------------------------------------------------------------------------------------
def save_weights(model: nn.Module, path: str | Path) -> str:
    """Atomically write the model's weights (tied matrices once) and return the file's SHA-256.

    Raises:
        OSError: the write failed (disk full, read-only directory, ...); the message names
            ``path`` and the reason, ``path`` keeps its previous content and no temporary is left.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = unique_tensors(model)
    with explain_write_errors(path, "weights"):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"format": "pt"})
            _fsync_file(Path(tmp))
            digest = sha256_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    return digest


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
    state = _unwrap(model).state_dict()
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
    model = _unwrap(model)
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


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel / compiled wrapper."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


# --- trainer state ------------------------------------------------------------------------------
def capture_rng() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """RNG states of torch (CPU and CUDA), Python and NumPy as (tensors, JSON)."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{index}"] = state
    kind, keys, position, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss = random.getstate()
    meta = {"numpy": [kind, int(position), int(has_gauss), float(cached)],
            "python": [version, list(internal), gauss]}
    return tensors, meta


def restore_rng(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    cuda = [tensors[key] for key in sorted(k for k in tensors if k.startswith("rng/cuda/"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    kind, position, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), position,
                         has_gauss, cached))
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, *,
                         state_dict: Mapping[str, Any] | None = None
                         ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split an optimizer state_dict (default: ``optimizer.state_dict()``; a distributed run
    passes the full one gathered from the shards) into safetensors-able tensors and JSON."""
    if state_dict is None:
        state_dict = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, slots in state_dict["state"].items():
        for slot, value in slots.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer/{index}/{slot}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[slot] = value
    groups = [{key: (list(value) if isinstance(value, tuple) else value)
               for key, value in group.items()} for group in state_dict["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: Mapping[str, Tensor],
                           meta: Mapping[str, Any], *,
                           load: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Rebuild the state_dict written by ``optimizer_to_tensors`` and load it (``load``: how, e.g.
    into FSDP-sharded parameters; default ``optimizer.load_state_dict``)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, slot = key.split("/", 2)
            state.setdefault(int(index), {})[slot] = value
    for index, slots in meta["scalars"].items():
        state.setdefault(int(index), {}).update(slots)
    groups = [{key: (tuple(value) if key == "betas" else value) for key, value in group.items()}
              for group in meta["param_groups"]]
    (load or optimizer.load_state_dict)({"state": state, "param_groups": groups})


def write_checkpoint(directory: str | Path, step: int, model: nn.Module,
                     tensors: Mapping[str, Tensor], meta: dict[str, Any]) -> Path:
    """Write ``directory/step-N`` atomically: a temporary directory renamed into place.

    Raises:
        OSError: the write failed (disk full, read-only directory, ...); the message names the
            checkpoint and the reason; earlier checkpoints are untouched and no temporary is left.
    """
    directory = Path(directory)
    final = directory / f"{CHECKPOINT_PREFIX}{step}"
    with explain_write_errors(final, "checkpoint"):
        _write_checkpoint(directory, final, model, tensors, {**meta, "step": step})
    fsync_dir(directory)
    return final


def _write_checkpoint(directory: Path, final: Path, model: nn.Module,
                      tensors: Mapping[str, Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".{final.name}.", suffix=TEMP_SUFFIX))
    try:
        files = {"model.safetensors": save_weights(model, tmp / "model.safetensors")}
        save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()},
                  str(tmp / "trainer_state.safetensors"))
        _fsync_file(tmp / "trainer_state.safetensors")
        files["trainer_state.safetensors"] = sha256_file(tmp / "trainer_state.safetensors")
        atomic_write_json(tmp / "trainer_state.json", {**meta, "sha256": files})
        fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. a resumed run reaching it again): swap
            remove_checkpoint(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_checkpoint(path: str | Path) -> None:
    """Delete a checkpoint directory so that no half-deleted ``step-N`` can ever be seen: it is
    renamed to a temporary name first (atomic), then removed."""
    path = Path(path)
    doomed = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.deleted.",
                                   suffix=TEMP_SUFFIX))
    os.rename(path, doomed)  # replaces the empty directory just made
    shutil.rmtree(doomed, ignore_errors=True)


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Delete what a killed writer left in ``directory``: ``.<name>.<random>.tmp`` files and
    directories (never a finished file). Returns the removed paths."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.name.startswith(".") and child.name.endswith(TEMP_SUFFIX):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
                removed.append(child)
    return removed


def read_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any], Path]:
    """Trainer tensors, trainer JSON and the weights path of a checkpoint directory, verified."""
    path = Path(path)
    meta_path = path / "trainer_state.json"
    if not meta_path.is_file():
        raise ValueError(f"{path}: not a checkpoint (no trainer_state.json)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{meta_path}: corrupt checkpoint state ({error})") from None
    if not isinstance(meta, dict) or "step" not in meta:
        raise ValueError(f"{meta_path}: corrupt checkpoint state (no step)")
    from aiayn.training.run import FORMAT_VERSION  # late: run.py imports this module

    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{meta_path}: checkpoint format version {version!r} is newer than this "
                         f"aiayn reads ({FORMAT_VERSION}); upgrade aiayn")
    sums = meta.get("sha256", {})
    tensors = read_tensors(path / "trainer_state.safetensors",
                           sha256=sums.get("trainer_state.safetensors"))
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{path}: corrupt checkpoint (model.safetensors missing)")
    if sums.get("model.safetensors") and sha256_file(weights) != sums["model.safetensors"]:
        raise ValueError(f"{weights}: checksum mismatch, the file is corrupt or was modified")
    return tensors, meta, weights


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint directories ``step-N`` sorted by N (temporary directories are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        if child.is_dir() and child.name.startswith(CHECKPOINT_PREFIX):
            suffix = child.name[len(CHECKPOINT_PREFIX):]
            if suffix.isdigit():
                found.append((int(suffix), child))
    return [path for _, path in sorted(found)]


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
