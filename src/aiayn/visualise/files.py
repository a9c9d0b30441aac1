"""Atomic file writes for the visualiser's outputs (temp file in the same folder, fsync, rename)."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from aiayn.training.checkpoint import usual_permissions


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success it is fsynced and renamed onto ``path``.

    The temporary name keeps the suffix, so writers that choose a format by extension (matplotlib)
    still see ``.png``. On error the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix,
                                         dir=path.parent)
    os.close(handle)
    temporary = Path(temporary)
    usual_permissions(temporary)
    try:
        yield temporary
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
