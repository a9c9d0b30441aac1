"""The run's metrics log: ``log.jsonl`` (one JSON object per logged step or evaluation), mirrored to
TensorBoard scalars with ``TrainingConfig.tensorboard``. Rank 0 writes; other ranks write nothing.

On resume, what a killed run logged after its last checkpoint is dropped from both (it is logged
again), so a resumed run's log equals an uninterrupted one's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiayn.training.checkpoint import atomic_write_bytes


class RunLog:
    """Append-only JSONL metrics log, optionally mirrored to TensorBoard.

    Args:
        path: the log file (``RUN_DIR/log.jsonl``).
        resume_step: the step of the checkpoint the run resumes from (None: a fresh run, which
            starts an empty log).
        tensorboard_dir: also write TensorBoard events here (None: not).
        enabled: whether this process writes (rank 0).

    Raises:
        ValueError: ``tensorboard_dir`` without the ``tensorboard`` package.
    """

    def __init__(self, path: Path, *, resume_step: int | None, tensorboard_dir: Path | None = None,
                 enabled: bool = True):
        self.path = path
        self.enabled = enabled
        self.writer = None
        if self.enabled and tensorboard_dir is not None:
            self.writer = _tensorboard_writer(tensorboard_dir, resume_step)
        if self.enabled and resume_step is not None and path.is_file():
            # A killed run may have logged past its last checkpoint: drop those lines, they will
            # be logged again by the resumed run. Rewritten atomically: a kill now loses nothing.
            kept = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the kill
            atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode("utf-8"))
        elif self.enabled and resume_step is None:
            atomic_write_bytes(path, b"")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            split, step = record.get("split", "train"), record["step"]
            for key, value in record.items():
                if key not in ("step", "split") and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self.writer.add_scalar(f"{split}/{key}", value, step)
            self.writer.flush()  # a killed run keeps what it logged, as log.jsonl does

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(directory: Path, resume_step: int | None):
    """A ``SummaryWriter`` on ``directory``; on resume, TensorBoard drops the events a killed run
    wrote after ``resume_step`` (``purge_step``), as ``RunLog`` drops those lines of log.jsonl."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ValueError("tensorboard logging needs the 'tensorboard' package: "
                         "pip install 'aiayn[tensorboard]' (or pip install tensorboard)") from error
    purge = None if resume_step is None else resume_step + 1
    return SummaryWriter(log_dir=str(directory), purge_step=purge)
