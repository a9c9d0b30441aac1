"""``TrainingConfig``: how to train, as a typed dataclass checked on construction (paper section 5
defaults). Batch sizes belong to the task; the model's shape to ``TransformerConfig``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from aiayn.training.distributed import STRATEGIES
from aiayn.training.schedules import Schedule


@dataclass(kw_only=True)
class TrainingConfig:
    """How to train (paper section 5 defaults). Batch sizes belong to the task.

    Fields:
        steps: optimizer updates to run in total.
        optimizer: "adam" (paper 5.3) or "adamw" (decoupled weight decay).
        betas, eps, weight_decay: optimizer hyper-parameters (paper: 0.9, 0.98, 1e-9, 0).
        decay_matrices_only: apply weight_decay only to parameters with 2+ dimensions (matrices
            and embeddings), not to biases and LayerNorm gains (GPT-2 / nanoGPT practice).
        schedule: the learning rate as a function of the step (paper: noam, warmup 4000).
        lr_scales: parameter-name prefix -> factor on the schedule's learning rate for the
            parameters whose names start with it (e.g. {"head.": 10.0}: a freshly initialised
            classification head learns 10x faster than the pretrained encoder); the longest
            matching prefix wins, other parameters get 1.
        accumulation: micro-batches per update; the gradient is normalised by their total units.
        clip_norm: clip the global gradient norm to this (None: no clipping).
        autocast: None (float32), "bf16" or "fp16" (fp16 adds a gradient scaler).
        eval_every / save_every / log_every: in steps (0: only at the end).
        keep_last: checkpoints kept on disk (older ones are deleted); 0 keeps all.
        average_last: at the end, average the weights of the last K checkpoints (paper 6.1: 5) and
            keep the average as the run's model if it scores better on ``best_metric`` (with no
            ``best_metric``, always: the paper's model). Under FSDP too: every rank evaluates it.
        best_metric / best_mode: the validation metric that picks the run's model ("min" | "max");
            None: the final weights, or their average with ``average_last``.
        seed: the torch/Python/NumPy seed ``train`` sets before its first step (dropout). The
            model comes built, so its initialisation is the caller's: ``aiayn train`` seeds
            with this value before building it; in Python, call ``torch.manual_seed`` first.
        nonfinite: what a non-finite (inf/NaN) loss or gradient does. "skip": that update is not
            applied (weights and optimizer state stay as they were), the step is logged
            (``"nonfinite": "skipped"``) and counted in ``skipped``. "raise": training stops
            with a ValueError naming the first bad step, before any later checkpoint, evaluation
            or weights file is written (checked at logging, saving and evaluation, so the device
            is not synchronised every step). With fp16 autocast the gradient scaler skips bad
            updates itself; ``skipped`` counts them too.
        progress: show a tqdm progress bar.
        device: "cpu", "cuda", ... (None: cuda if available).
        time_limit: seconds of training in this process after which no new step starts (at least
            one step runs; None: no limit); the run then finishes as if ``steps`` were reached.
        distributed: under torchrun (an initialised process group with 2+ ranks), "ddp"
            (DistributedDataParallel) or "fsdp" (FSDP2 fully_shard); see training/distributed.py.
            ``accumulation`` is per rank: the global batch is task batch x accumulation x ranks.
        activation_checkpointing: recompute each layer's activations in the backward pass.
        compile: ``torch.compile`` the task's loss, the model and its loss in one graph (under
            DDP / FSDP each encoder/decoder layer instead: ``layer_wrappers.compile_layers``);
            parameter names and checkpoints are unchanged.
        tensorboard: also write every logged metric to ``RUN_DIR/tensorboard`` as TensorBoard
            scalars (tag ``split/metric``; needs the ``tensorboard`` package). ``log.jsonl`` is
            written either way and stays the record resume relies on.
    """

    steps: int = 100_000
    optimizer: Literal["adam", "adamw"] = "adam"
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    decay_matrices_only: bool = False
    schedule: Schedule = field(default_factory=Schedule)
    lr_scales: dict[str, float] = field(default_factory=dict)
    accumulation: int = 1
    clip_norm: float | None = None
    autocast: Literal["bf16", "fp16"] | None = None
    eval_every: int = 1000
    save_every: int = 1000
    log_every: int = 10
    keep_last: int = 5
    average_last: int = 0
    best_metric: str | None = "loss"
    best_mode: Literal["min", "max"] = "min"
    seed: int = 0
    nonfinite: Literal["skip", "raise"] = "skip"
    progress: bool = True
    device: str | None = None
    time_limit: float | None = None
    distributed: Literal["ddp", "fsdp"] = "ddp"
    activation_checkpointing: bool = False
    compile: bool = False
    tensorboard: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.schedule, dict):
            self.schedule = Schedule(**self.schedule)
        self.betas = tuple(self.betas)
        for name in ("steps", "accumulation", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("eval_every", "save_every", "keep_last", "average_last", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        self.lr_scales = dict(self.lr_scales)
        for prefix, factor in self.lr_scales.items():
            if not isinstance(prefix, str) or not prefix:
                raise ValueError(f"lr_scales keys must be parameter-name prefixes, got {prefix!r}")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise ValueError(f"lr_scales[{prefix!r}] must be a positive number, got {factor!r}")
        if self.optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be 'adam' or 'adamw', got {self.optimizer!r}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {self.weight_decay!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive or None, got {self.clip_norm!r}")
        if self.autocast not in (None, "bf16", "fp16"):
            raise ValueError(f"autocast must be None, 'bf16' or 'fp16', got {self.autocast!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit must be positive or None, got {self.time_limit!r}")
        if self.distributed not in STRATEGIES:
            raise ValueError(f"distributed must be one of {STRATEGIES}, got "
                             f"{self.distributed!r}")
        if self.keep_last and self.average_last > self.keep_last:
            raise ValueError(f"average_last ({self.average_last}) needs keep_last >= it, got "
                             f"keep_last={self.keep_last}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainingConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config key(s): {', '.join(unknown)}")
        return cls(**data)
