"""The training loop: Adam + schedule, token-normalised gradient accumulation, clipping, autocast,
evaluation, checkpoints and exact resume, for any ``Task``.

One optimizer step = ``accumulation`` micro-batches. Each micro-batch loss is a SUM over its units;
the gradient is divided by the units of all micro-batches together, so accumulating k batches equals
one batch k times larger (what the paper's 25k-token batches mean), whatever their padding.

A resumed run continues exactly: the checkpoint holds weights, optimizer moments, the step, the RNG
states and the data position (epoch, batch index), and the task's batches are a deterministic function
of (seed, epoch), so the resumed loss curve equals the uninterrupted one.

Per-step cost is kept low: losses are summed on the device and read back (a device sync) only every
``log_every`` steps. The one exception is ``nonfinite="skip"`` without fp16, which reads the gradient
norm each step to decide whether to apply the update (free on CPU; use "raise" to avoid it on GPU).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from aiayn.training import distributed, rank_agreement
from aiayn.training.checkpoint import (
    atomic_write_bytes, atomic_write_json, list_checkpoints, read_checkpoint, remove_checkpoint,
    remove_temporaries, save_weights, write_checkpoint)
from aiayn.training.run import (
    CHECKPOINT_DIR, FORMAT_VERSION, LOG_FILE, RUN_FILE, TENSORBOARD_DIR, WEIGHTS_FILE, qualified_name,
    read_run_info)
from aiayn.training.schedules import Schedule
from aiayn.training.task import Task
from aiayn.training.trainer_state import (capture_rng, optimizer_from_tensors,
                                          optimizer_to_tensors, restore_rng)
from aiayn.training.weights import assign_weights, average_checkpoints, load_weights


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
        accumulation: micro-batches per update; the gradient is normalised by their total units.
        clip_norm: clip the global gradient norm to this (None: no clipping).
        autocast: None (float32), "bf16" or "fp16" (fp16 adds a gradient scaler).
        eval_every / save_every / log_every: in steps (0: only at the end).
        keep_last: checkpoints kept on disk (older ones are deleted); 0 keeps all.
        average_last: at the end, average the weights of the last K checkpoints (paper 6.1: 5) and
            keep the average as the run's model if it scores better on ``best_metric``.
        best_metric / best_mode: the validation metric that picks the run's model ("min" | "max");
            None: the final weights.
        seed: torch/Python/NumPy seed for initialisation and dropout.
        nonfinite: what a non-finite (inf/NaN) loss or gradient does. "skip": that update is not
            applied (weights and optimizer state stay as they were), the step is logged
            (``"nonfinite": "skipped"``) and counted in ``skipped``. "raise": training stops
            with a ValueError naming the first bad step, before any later checkpoint, evaluation
            or weights file is written (checked at logging, saving and evaluation, so the device
            is not synchronised every step). With fp16 autocast the gradient scaler skips bad
            updates itself.
        progress: show a tqdm progress bar.
        device: "cpu", "cuda", ... (None: cuda if available).
        time_limit: seconds of training in this process after which no new step starts (at least
            one step runs; None: no limit); the run then finishes as if ``steps`` were reached.
        distributed: under torchrun (an initialised process group with 2+ ranks), "ddp"
            (DistributedDataParallel) or "fsdp" (FSDP2 fully_shard); see training/distributed.py.
            ``accumulation`` is per rank: the global batch is task batch x accumulation x ranks.
        activation_checkpointing: recompute each layer's activations in the backward pass.
        compile: ``torch.compile`` each encoder/decoder layer (in place; names and checkpoints are
            unchanged; the chunked loss stays eager: ``distributed.compile_layers``).
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
        if self.distributed not in distributed.STRATEGIES:
            raise ValueError(f"distributed must be one of {distributed.STRATEGIES}, got "
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


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _is_main_process() -> bool:
    """Rank 0 writes files (ready for torch.distributed; always True in one process)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _Log:
    """Append-only JSONL metrics log, optionally mirrored to TensorBoard (rank 0 only)."""

    def __init__(self, path: Path, *, resume_step: int | None, tensorboard_dir: Path | None = None):
        self.path = path
        self.enabled = _is_main_process()
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
    wrote after ``resume_step`` (``purge_step``), as ``_Log`` drops those lines of log.jsonl."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ValueError("tensorboard logging needs the 'tensorboard' package: "
                         "pip install 'aiayn[tensorboard]' (or pip install tensorboard)") from error
    purge = None if resume_step is None else resume_step + 1
    return SummaryWriter(log_dir=str(directory), purge_step=purge)


class _Batches:
    """The task's batches across epochs from a (epoch, index) position."""

    def __init__(self, task: Task, epoch: int, index: int):
        self.task, self.epoch, self.index = task, epoch, index
        self._iterator = itertools.islice(task.train_batches(epoch), index, None)

    def next(self) -> Any:
        for _ in range(2):
            try:
                batch = next(self._iterator)
            except StopIteration:
                self.epoch, self.index = self.epoch + 1, 0
                self._iterator = iter(self.task.train_batches(self.epoch))
                continue
            self.index += 1
            return batch
        raise ValueError(f"task {self.task.name!r} yielded no training batches (epoch "
                         f"{self.epoch}); is the training data empty?")


def _better(value: float, best: float | None, mode: str) -> bool:
    if best is None or not math.isfinite(best):
        return math.isfinite(value)
    return value < best if mode == "min" else value > best


def _evaluate(model: nn.Module, task: Task) -> dict[str, float]:
    """Validation metrics, without disturbing the training RNG streams (exact resume)."""
    was_training = model.training
    model.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        metrics = {key: float(value) for key, value in task.evaluate(model).items()}
    model.train(was_training)
    return metrics


def _write_run_info(run_dir: Path, updates: dict[str, Any]) -> dict[str, Any]:
    path = run_dir / RUN_FILE
    info = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    info.update(updates)
    info = {key: value for key, value in info.items() if value is not None}
    atomic_write_json(path, info)
    return info


def _publish_weights(run_dir: Path, model: nn.Module, source: str, metrics: dict[str, Any]
                     ) -> None:
    """Write RUN_DIR/model.safetensors; run.json's checksum is dropped first and set after, so a
    crash in between never leaves a checksum that does not match the file."""
    _write_run_info(run_dir, {"weights_sha256": None})
    digest = save_weights(model, run_dir / WEIGHTS_FILE)
    _write_run_info(run_dir, {"weights_sha256": digest, "weights_source": source,
                              "weights_metrics": metrics})


def _fused_optimizer_applies(parameters: list[nn.Parameter]) -> bool:
    """Whether torch's fused Adam(W) takes these parameters: plain CPU/CUDA floating tensors.

    The fused update is one kernel per step instead of a Python loop over the tensors: the same
    arithmetic, about 3x faster on CPU for the baby GPT (7.6 -> 2.5 ms of a ~190 ms step). Sharded
    (FSDP DTensor) parameters keep torch's default implementation.
    """
    return bool(parameters) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() and type(p.data) is torch.Tensor
        for p in parameters)


def make_optimizer(model: nn.Module, config: TrainingConfig) -> torch.optim.Optimizer:
    """The optimizer ``train`` builds for ``model``: Adam or AdamW with the config's settings over the
    trainable parameters (matrices only decayed with ``decay_matrices_only``), torch's fused
    implementation where it applies, at the schedule's step-1 learning rate."""
    optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups: Any = trainable
    if config.decay_matrices_only and config.weight_decay:
        groups = [{"params": [p for p in trainable if p.dim() >= 2]},
                  {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    return optimizer_class(groups, lr=config.schedule(1), betas=config.betas,
                           eps=config.eps, weight_decay=config.weight_decay,
                           fused=_fused_optimizer_applies(trainable) or None)


def train(model: nn.Module, task: Task, config: TrainingConfig, run_dir: str | Path, *,
          model_config: Any = None, resume: bool = True) -> dict[str, float]:
    """Train ``model`` on ``task`` and write the run directory.

    Args:
        model: built by ``task.build_model``; moved to ``config.device``.
        task: the job (data, loss, metrics, assets).
        config: the training settings.
        run_dir: where run.json, checkpoints, log.jsonl and the final weights go.
        model_config: the ``TransformerConfig`` the model was built from (default: ``model.config``).
        resume: continue from the latest checkpoint in ``run_dir`` if there is one; with False, a
            ``run_dir`` that already holds checkpoints is an error.

    Returns:
        The last validation metrics (plus "step").

    Raises:
        ValueError: a run of another task or config in ``run_dir``, a corrupt checkpoint, a
            non-finite loss with ``nonfinite="raise"``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_config = model_config if model_config is not None else getattr(model, "config", None)
    if model_config is None:
        raise ValueError("train needs the model config (pass model_config=)")
    checkpoint_dir = run_dir / CHECKPOINT_DIR
    checkpoints = list_checkpoints(checkpoint_dir)
    if checkpoints and not resume:
        raise ValueError(f"{run_dir} already holds a run with checkpoints; resume it or choose "
                         f"another directory")
    if checkpoints:
        info = read_run_info(run_dir)
        if info["task"] != task.name:
            raise ValueError(f"{run_dir} holds a run of task {info['task']!r}, not {task.name!r}")
        if info["model_config"] != model_config.to_dict():
            changed = sorted(key for key, value in model_config.to_dict().items()
                             if info["model_config"].get(key) != value)
            raise ValueError(f"{run_dir} holds a run with another model config (differs in "
                             f"{', '.join(changed)}); resume with the same settings or use "
                             f"another directory")

    device = _resolve_device(config.device)
    # All three generators (the checkpoint saves all three): a fresh run is a function of the
    # seed alone, so a killed-and-resumed run ends bit-identical to an uninterrupted one.
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed % 2**32)
    model.to(device)
    model.train()
    main = _is_main_process()
    if main:  # what a killed writer left behind (never a finished file)
        remove_temporaries(run_dir)
        remove_temporaries(checkpoint_dir)
    parallel = distributed.Parallel(config.distributed, device)
    if parallel.strategy == "fsdp" and config.average_last:
        raise ValueError("average_last is not supported with distributed='fsdp' (it evaluates the "
                         "averaged weights on rank 0 alone); average the checkpoints afterwards")
    # Every rank must train the same thing from the same place: compare digests before any write.
    parallel.check_agreement({
        "training config": {key: value for key, value in config.to_dict().items()
                            if key not in ("device", "progress")},
        "model config": model_config.to_dict(), "task": task.name,
        "training data": rank_agreement.data_fingerprint(task),
        "initial weights": rank_agreement.parameter_fingerprint(model),
        "checkpoint to resume": (checkpoints[-1] / "trainer_state.json").read_bytes()
        if checkpoints else None})
    if checkpoints:  # weights go in before FSDP shards them
        tensors, meta, weights = read_checkpoint(checkpoints[-1])
        load_weights(model, weights)
    plain_model = model
    model = parallel.wrap(model, activation_checkpointing=config.activation_checkpointing,
                          compile=config.compile)

    if main:
        assets = task.save_assets(run_dir) or {}
        _write_run_info(run_dir, {
            "format_version": FORMAT_VERSION, "task": task.name,
            "task_class": qualified_name(task), "model_class": qualified_name(plain_model),
            "model_config": model_config.to_dict(), "training_config": config.to_dict(),
            "assets": assets})

    optimizer = make_optimizer(model, config)
    scaler = torch.amp.GradScaler(device.type) if config.autocast == "fp16" else None
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.autocast or "")

    step, epoch, batch_index = 0, 0, 0
    best: float | None = None
    skipped = 0
    units_total = 0
    if parallel.rank:  # other dropout masks than rank 0's (rank 0 keeps the 1-process stream)
        torch.manual_seed(distributed.rank_seed(config.seed, parallel.rank, 0))
    if checkpoints:
        optimizer_from_tensors(optimizer, tensors, meta["optimizer"],
                               load=lambda state: parallel.load_optimizer_state_dict(optimizer,
                                                                                     state))
        restore_rng(tensors, meta["rng"])
        parallel.restore_rank_rng(tensors, seed=config.seed, step=meta["step"])
        if scaler is not None and meta.get("scaler"):
            scaler.load_state_dict(meta["scaler"])
        step, epoch, batch_index = meta["step"], meta["epoch"], meta["batch_index"]
        best, skipped, units_total = meta.get("best"), meta.get("skipped", 0), meta.get("units", 0)
    log = _Log(run_dir / LOG_FILE, resume_step=step if checkpoints else None,
               tensorboard_dir=run_dir / TENSORBOARD_DIR if config.tensorboard else None)
    batches = _Batches(task, epoch, batch_index)

    def save_checkpoint() -> None:
        full_model = parallel.full_model()  # collectives under FSDP: every rank gets here
        optimizer_state = parallel.optimizer_state_dict(optimizer)
        rank_rng = parallel.gather_rng_states()
        if not main:
            return
        opt_tensors, opt_meta = optimizer_to_tensors(optimizer, state_dict=optimizer_state)
        rng_tensors, rng_meta = capture_rng()
        meta = {"format_version": FORMAT_VERSION, "epoch": batches.epoch,
                "batch_index": batches.index, "optimizer": opt_meta, "rng": rng_meta,
                "best": best, "skipped": skipped, "units": units_total,
                "scaler": scaler.state_dict() if scaler is not None else None,
                # A run killed after its last checkpoint resumes without evaluating (and logging)
                # that step a second time.
                "evaluated": last_eval_step == step, "metrics": metrics}
        write_checkpoint(checkpoint_dir, step, full_model,
                         {**opt_tensors, **rng_tensors, **rank_rng}, meta)
        if config.keep_last:
            for old in list_checkpoints(checkpoint_dir)[:-config.keep_last]:
                remove_checkpoint(old)

    first_nonfinite = torch.zeros((), dtype=torch.long, device=device)  # 0: none yet

    def check_finite() -> None:
        """nonfinite="raise": stop before anything is written after a bad step (one sync)."""
        if config.nonfinite != "raise":
            return
        ranks_hit = int(parallel.sum((first_nonfinite > 0).to(torch.float64)).item())
        if ranks_hit:
            where = int(first_nonfinite.item())
            raise ValueError(
                f"non-finite training loss or gradient at step {where}" if where else
                f"non-finite training loss or gradient on another rank (before step {step})")

    def run_evaluation() -> dict[str, float]:
        nonlocal best
        check_finite()
        metrics = _evaluate(parallel.eval_model, task)
        log.write({"step": step, "split": "valid", **metrics})
        metric = config.best_metric
        if metric is not None:
            if metric not in metrics:
                raise ValueError(f"best_metric {metric!r} is not among the task's metrics "
                                 f"{sorted(metrics)}")
            if _better(metrics[metric], best, config.best_mode):
                best = metrics[metric]
                full_model = parallel.full_model()  # every rank: the metrics are the same
                if main:
                    _publish_weights(run_dir, full_model, f"best@{step}", metrics)
        return metrics

    progress = None
    if config.progress and main:
        from tqdm.auto import tqdm

        progress = tqdm(total=config.steps, initial=step, desc=f"train {task.name}",
                        dynamic_ncols=True, mininterval=1.0)

    parameters = [p for p in model.parameters() if p.requires_grad]
    metrics: dict[str, float] = {}
    last_eval_step = last_save_step = -1
    if checkpoints and meta.get("evaluated"):
        metrics, last_eval_step = meta.get("metrics", {}), step
    window_loss = torch.zeros((), device=device, dtype=torch.float64)
    window_units = 0
    window_start = time.perf_counter()
    grad_norm = torch.zeros((), device=device)
    train_start, cpu_start = time.perf_counter(), time.process_time()
    first_step = step
    while step < config.steps:
        # Every rank stops at the same step (rank 0's clock decides; a collective only with a
        # limit).
        if config.time_limit is not None and step > first_step and parallel.agree(
                time.perf_counter() - train_start > config.time_limit):
            log.write({"step": step, "split": "train", "stopped": "time_limit",
                       "seconds": time.perf_counter() - train_start})
            break
        micro = parallel.step_batches(batches, config.accumulation)  # this rank's share
        units = parallel.global_count(sum(task.count(batch) for batch in micro))
        if units <= 0:
            raise ValueError(f"step {step + 1}: the accumulated batches hold no loss units")
        step_loss = torch.zeros((), device=device, dtype=torch.float64)
        for index, batch in enumerate(micro):
            with parallel.gradient_sync(index == len(micro) - 1), \
                    torch.autocast(device.type, dtype=autocast_dtype,
                                   enabled=autocast_dtype is not None):
                loss = task.loss(model, batch)
            # Normalise by the true unit count of the whole (global) step; gradient_scale undoes
            # the DDP/FSDP average over ranks.
            scaled = loss.float() * parallel.gradient_scale / units
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            step_loss += loss.detach().double()
        window_loss += step_loss
        window_units += units
        units_total += units
        step += 1
        lr = config.schedule(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm_now = config.clip_norm is not None or config.nonfinite == "skip" \
            or step % config.log_every == 0
        if norm_now:
            grad_norm = parallel.grad_norm(parameters, config.clip_norm)
        if config.nonfinite == "raise":  # tracked on the device: no sync here
            finite = torch.isfinite(step_loss)
            if norm_now and scaler is None:  # fp16: the scaler handles inf gradients itself
                finite = finite & torch.isfinite(grad_norm)
            first_nonfinite = torch.where((first_nonfinite == 0) & ~finite,
                                          torch.full_like(first_nonfinite, step), first_nonfinite)
        if scaler is not None:
            scaler.step(optimizer)  # skips the update itself on inf/NaN and lowers the scale
            scaler.update()
        elif config.nonfinite == "skip" and not torch.isfinite(grad_norm).item():
            skipped += 1
            log.write({"step": step, "split": "train", "nonfinite": "skipped",
                       "skipped": skipped})
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % config.log_every == 0 or step == config.steps:
            mean_loss = parallel.sum(window_loss).item() / max(window_units, 1)
            check_finite()
            elapsed = time.perf_counter() - window_start
            record = {"step": step, "split": "train", "loss": mean_loss,
                      "ppl": math.exp(min(mean_loss, 50.0)), "lr": lr,
                      "grad_norm": float(grad_norm), "units_per_s": window_units / elapsed,
                      "epoch": batches.epoch, "skipped": skipped,
                      "seconds": time.perf_counter() - train_start,
                      "cpu_seconds": time.process_time() - cpu_start}
            log.write(record)
            if progress is not None:
                progress.set_postfix(loss=f"{mean_loss:.3f}", ppl=f"{record['ppl']:.1f}",
                                     lr=f"{lr:.2e}", tok_s=f"{record['units_per_s']:.0f}",
                                     refresh=False)
            window_loss.zero_()
            window_units = 0
            window_start = time.perf_counter()
        if progress is not None:
            progress.update(1)
        if config.eval_every and step % config.eval_every == 0:
            metrics = run_evaluation()
            last_eval_step = step
            if progress is not None:
                progress.write(f"step {step}: " + ", ".join(f"{k} {v:.4g}"
                                                            for k, v in metrics.items()))
        if config.save_every and step % config.save_every == 0:
            check_finite()
            save_checkpoint()
            last_save_step = step
    if progress is not None:
        progress.close()

    check_finite()
    if last_eval_step != step:
        metrics = run_evaluation()
        last_eval_step = step
    if last_save_step != step and not parallel.agree((checkpoint_dir / f"step-{step}").is_dir()):
        save_checkpoint()
    final_model = parallel.full_model()  # the plain module; gathered to rank 0 under FSDP
    if main:
        if config.average_last:
            recent = list_checkpoints(checkpoint_dir)[-config.average_last:]
            final_state = {k: v.detach().clone() for k, v in final_model.state_dict().items()}
            assign_weights(final_model, average_checkpoints(recent), source="checkpoint average")
            averaged = _evaluate(final_model, task)
            log.write({"step": step, "split": "valid_averaged", "checkpoints": len(recent),
                       **averaged})
            metric = config.best_metric
            if metric is None or _better(averaged[metric], best, config.best_mode):
                best = averaged.get(metric) if metric else None
                metrics = averaged
                _publish_weights(run_dir, final_model, f"average of {len(recent)}@{step}",
                                 averaged)
            final_model.load_state_dict(final_state)
        if config.best_metric is None or not (run_dir / WEIGHTS_FILE).is_file():
            _publish_weights(run_dir, final_model, f"final@{step}", metrics)
        _write_run_info(run_dir, {"final_metrics": metrics, "steps_done": step,
                                  "best": best})
    log.close()
    return {**metrics, "step": step}
