"""Every file the trainer writes, written atomically; and the checkpoint directories.

A checkpoint directory ``checkpoints/step-N/`` holds ``model.safetensors`` (weights),
``trainer_state.safetensors`` (optimizer moments, RNG states: ``trainer_state.py``) and
``trainer_state.json`` (step, data position, optimizer hyper-parameters, best metric, SHA-256 of
both tensor files). It is written into a temporary sibling directory and renamed into place, so a crash
mid-write never leaves a half-written ``step-N`` and never touches the previous checkpoint. Single
files (run.json, log.jsonl, the published weights) go through a temporary file, fsync and rename.

Every write goes through this module's ``os``, which the fault-injection tests replace to fail or
pause a chosen rename; a failed write raises one ``OSError`` that names the path and the reason.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from aiayn.training.weights import read_tensors, sha256_file, unique_tensors

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
def usual_permissions(path: str | Path, *, directory: bool = False) -> None:
    """Give a temporary file or directory about to be renamed into place the permissions
    ``open`` / ``mkdir`` would have given it (0666 / 0777 less the umask): mkstemp and mkdtemp
    make them 0600 / 0700, which would leave a run readable by its owner alone."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


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
            usual_permissions(tmp)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


def write_output(path: str | Path, data: bytes) -> None:
    """Write a command's ``--output``: ``-`` is stdout; an existing FIFO or device
    (``/dev/stdout``, a pipe) is written through, having no content to keep; a symbolic link's
    target is replaced, not the link; any other path atomically (``atomic_write_bytes``)."""
    import sys

    if str(path) == "-":
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        with explain_write_errors(path, "file"), open(path, "wb") as handle:
            handle.write(data)
        return
    atomic_write_bytes(path.resolve() if path.is_symlink() else path, data)


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


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
            usual_permissions(tmp)  # after: safetensors writes a file of its own
            _fsync_file(Path(tmp))
            digest = sha256_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    return digest


# --- checkpoint directories -----------------------------------------------------------------------
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
        usual_permissions(tmp, directory=True)
        files = {"model.safetensors": save_weights(model, tmp / "model.safetensors")}
        save_file({key: value.detach().cpu().contiguous() for key, value in tensors.items()},
                  str(tmp / "trainer_state.safetensors"))
        usual_permissions(tmp / "trainer_state.safetensors")  # safetensors makes it 0600
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


# What ``tempfile`` names our temporaries: ".<final name>." + 8 random characters + ".tmp".
_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}" + re.escape(TEMP_SUFFIX))


def remove_temporaries(directory: str | Path) -> list[Path]:
    """Delete what a killed writer left in ``directory``: ``.<name>.<random>.tmp`` files and
    directories, named as ``tempfile`` names ours (never a finished file, nor a user's own
    ``.notes.tmp``). Returns the removed paths."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for child in directory.iterdir():
            if _TEMPORARY.fullmatch(child.name):
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
