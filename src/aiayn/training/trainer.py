"""The training loop for any ``Task``, as a ``Trainer`` whose work reads as named steps: ``resume``,
``step``, ``evaluate``, ``save`` and ``finish``, driven by ``run``. ``train`` is the public entry.

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

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.training.batch_stream import BatchStream
from aiayn.training.checkpoint import (list_checkpoints, read_checkpoint, remove_checkpoint,
                                       remove_temporaries, write_checkpoint)
from aiayn.training.config import TrainingConfig
from aiayn.training.devices import default_device
from aiayn.training.distributed import Parallel, rank_seed
from aiayn.training.optimizer import make_optimizer
from aiayn.training.rank_agreement import data_fingerprint, parameter_fingerprint
from aiayn.training.run import (CHECKPOINT_DIR, FORMAT_VERSION, LOG_FILE, TENSORBOARD_DIR,
                                WEIGHTS_FILE, checkpoints_to_resume, publish_weights,
                                published_metric, qualified_name, update_run_info)
from aiayn.training.run_log import RunLog
from aiayn.training.task import Task
from aiayn.training.trainer_state import (capture_rng, optimizer_from_tensors,
                                          optimizer_to_tensors, restore_rng, seed_all)
from aiayn.training.validation import check_best_metric, evaluate_model, is_better
from aiayn.training.weights import average_checkpoints, load_weights, read_tensors


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
    trainer = Trainer(model, task, config, run_dir, model_config=model_config, resume=resume)
    try:
        return trainer.run()
    finally:
        trainer.close()


class Trainer:
    """One training run: the model (wrapped for DDP/FSDP), optimizer, data position and counters.

    Construction checks the run directory, seeds, checks that every rank agrees, loads the latest
    checkpoint's weights (before FSDP shards the model), writes run.json and ``resume``s. The
    arguments are those of ``train``.
    """

    def __init__(self, model: nn.Module, task: Task, config: TrainingConfig, run_dir: str | Path,
                 *, model_config: Any = None, resume: bool = True):
        self.task, self.config, self.run_dir = task, config, Path(run_dir)
        check_best_metric(task, config.best_metric)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model_config = model_config if model_config is not None \
            else getattr(model, "config", None)
        if self.model_config is None:
            raise ValueError("train needs the model config (pass model_config=)")
        self.checkpoint_dir = self.run_dir / CHECKPOINT_DIR
        checkpoints = checkpoints_to_resume(self.run_dir, task, self.model_config.to_dict(),
                                            resume=resume, training_config=config.to_dict())

        self.device = torch.device(default_device(config.device))
        # All three generators (the checkpoint saves all three): a fresh run is a function of the
        # seed alone, so a killed-and-resumed run ends bit-identical to an uninterrupted one.
        seed_all(config.seed)
        model.to(self.device)
        model.train()
        self.parallel = Parallel(config.distributed, self.device)
        self.main = self.parallel.main  # rank 0 writes the files
        if self.main:  # what a killed writer left behind (never a finished file)
            remove_temporaries(self.run_dir)
            remove_temporaries(self.checkpoint_dir)
        # Every rank must train the same thing from the same place: compare digests before any
        # write.
        self.parallel.check_agreement({
            "training config": {key: value for key, value in config.to_dict().items()
                                if key not in ("device", "progress")},
            "model config": self.model_config.to_dict(), "task": task.name,
            "training data": data_fingerprint(task),
            "initial weights": parameter_fingerprint(model),
            "checkpoint to resume": (checkpoints[-1] / "trainer_state.json").read_bytes()
            if checkpoints else None})
        self._checkpoint = None
        if checkpoints:  # weights go in before FSDP shards them; the rest in resume()
            tensors, meta, weights = read_checkpoint(checkpoints[-1])
            if meta["step"] > config.steps:  # would train nothing and record the smaller total
                raise ValueError(f"{self.run_dir} is at step {meta['step']}, past steps="
                                 f"{config.steps} (--steps): give more steps to train further, "
                                 f"or train into another directory")
            load_weights(model, weights)
            self._checkpoint = (tensors, meta)
        self.model = self.parallel.wrap(
            model, activation_checkpointing=config.activation_checkpointing, compile=config.compile)
        # One process compiles the task's loss: the model and the loss in one graph (what makes a
        # GPU step fast; benchmarks/gpu.py). DDP / FSDP compile their layers instead (``wrap``).
        self.loss = (torch.compile(task.loss) if config.compile and not self.parallel.active
                     else task.loss)
        if self.main:
            assets = task.save_assets(self.run_dir) or {}
            update_run_info(self.run_dir, {
                "format_version": FORMAT_VERSION, "task": task.name,
                "task_class": qualified_name(task), "model_class": qualified_name(model),
                "model_config": self.model_config.to_dict(), "training_config": config.to_dict(),
                "assets": assets})

        self.optimizer = make_optimizer(self.model, config)
        self.scaler = torch.amp.GradScaler(self.device.type) if config.autocast == "fp16" else None
        # the updates the scaler skipped in this process (on the device: counted without a sync)
        self.scaler_skips = torch.zeros((), dtype=torch.int64, device=self.device)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            config.autocast or "")
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.steps_done, self.best, self.skipped, self.units_total = 0, None, 0, 0
        self.metrics: dict[str, float] = {}
        self.last_eval_step = self.last_save_step = -1
        if self.parallel.rank:  # other dropout masks than rank 0's (rank 0: the 1-process stream)
            torch.manual_seed(rank_seed(config.seed, self.parallel.rank, 0))
        epoch, batch_index = self.resume()
        self.log = RunLog(self.run_dir / LOG_FILE, enabled=self.main,
                          resume_step=self.steps_done if checkpoints else None,
                          tensorboard_dir=self.run_dir / TENSORBOARD_DIR
                          if config.tensorboard else None)
        self.batches = BatchStream(task, epoch, batch_index)
        self.first_nonfinite = torch.zeros((), dtype=torch.long, device=self.device)  # 0: none
        self.grad_norm = torch.zeros((), device=self.device)  # the last step's
        self.lr = 0.0  # the last step's
        # What log_train reports: the loss and units since the last log, and the clocks.
        self.window_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        self.window_units = 0
        self.window_start = self.train_start = self.cpu_start = 0.0
        self.progress = None

    def resume(self) -> tuple[int, int]:
        """Continue from the checkpoint read at construction: optimizer moments, every rank's RNG
        states, the gradient scaler, the step and counters. Returns the data position (epoch,
        batch index): (0, 0) for a fresh run."""
        if self._checkpoint is None:
            return 0, 0
        tensors, meta = self._checkpoint
        self._checkpoint = None
        optimizer_from_tensors(self.optimizer, tensors, meta["optimizer"],
                               load=lambda state: self.parallel.load_optimizer_state_dict(
                                   self.optimizer, state))
        restore_rng(tensors, meta["rng"])
        self.parallel.restore_rank_rng(tensors, seed=self.config.seed, step=meta["step"])
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])
        self.steps_done = meta["step"]
        self.best, self.skipped = meta.get("best"), meta.get("skipped", 0)
        # The published weights may be better than any checkpoint's: the average of the last
        # checkpoints, published after the last one was written. Later weights must beat them.
        metric = self.config.best_metric
        published = published_metric(self.run_dir, metric) if metric is not None else None
        if published is not None and is_better(published, self.best, self.config.best_mode):
            self.best = published
        self.units_total = meta.get("units", 0)
        if meta.get("evaluated"):  # killed after its last checkpoint: not evaluated twice
            self.metrics, self.last_eval_step = meta.get("metrics", {}), self.steps_done
        return meta["epoch"], meta["batch_index"]

    def run(self) -> dict[str, float]:
        """Steps until ``config.steps`` (or the time limit), logging, evaluating and saving at their
        intervals; then ``finish``. Returns the last validation metrics (plus "step")."""
        config = self.config
        if config.progress and self.main:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=config.steps, initial=self.steps_done,
                                 desc=f"train {self.task.name}", dynamic_ncols=True,
                                 mininterval=1.0)
        self.window_start = self.train_start = time.perf_counter()
        self.cpu_start = time.process_time()
        first_step = self.steps_done
        while self.steps_done < config.steps:
            # Every rank stops at the same step (rank 0's clock decides; a collective only with a
            # limit).
            if config.time_limit is not None and self.steps_done > first_step and \
                    self.parallel.agree(time.perf_counter() - self.train_start > config.time_limit):
                self.log.write({"step": self.steps_done, "split": "train", "stopped": "time_limit",
                                "seconds": time.perf_counter() - self.train_start})
                break
            self.step()
            step = self.steps_done
            if step % config.log_every == 0 or step == config.steps:
                self.log_train()
            if self.progress is not None:
                self.progress.update(1)
            if config.eval_every and step % config.eval_every == 0:
                metrics = self.evaluate()
                if self.progress is not None:
                    self.progress.write(f"step {step}: " + ", ".join(
                        f"{k} {v:.4g}" for k, v in metrics.items()))
            if config.save_every and step % config.save_every == 0:
                self.check_finite()
                self.save()
        return self.finish()

    def step(self) -> None:
        """One optimizer update over this rank's micro-batches of the step: forward and backward
        (the loss normalised by the units of the whole global step), the learning rate, gradient
        clipping, non-finite handling and the update."""
        config, parallel = self.config, self.parallel
        micro = parallel.step_batches(self.batches, config.accumulation)  # this rank's share
        units = parallel.global_count(sum(self.task.count(batch) for batch in micro))
        if units <= 0:
            raise ValueError(f"step {self.steps_done + 1}: the accumulated batches hold no loss "
                             f"units")
        step_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        for index, batch in enumerate(micro):
            with parallel.gradient_sync(index == len(micro) - 1), \
                    torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                   enabled=self.autocast_dtype is not None):
                loss = self.loss(self.model, batch)
            # Normalise by the true unit count of the whole (global) step; gradient_scale undoes
            # the DDP/FSDP average over ranks.
            scaled = loss.float() * parallel.gradient_scale / units
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            step_loss += loss.detach().double()
        self.window_loss += step_loss
        self.window_units += units
        self.units_total += units
        self.steps_done += 1
        step = self.steps_done
        self.lr = config.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_scale", 1.0)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # Every step (on the device, no sync): "skip" and "raise" both judge each step by it.
        self.grad_norm = parallel.grad_norm(self.parameters, config.clip_norm)
        if self.scaler is not None:  # it skips exactly the steps with an inf/NaN gradient
            self.scaler_skips += (~torch.isfinite(self.grad_norm)).any()
        if config.nonfinite == "raise":  # tracked on the device: no sync here
            finite = torch.isfinite(step_loss)
            if self.scaler is None:  # fp16: the scaler handles inf gradients itself
                finite = finite & torch.isfinite(self.grad_norm)
            self.first_nonfinite = torch.where((self.first_nonfinite == 0) & ~finite,
                                               torch.full_like(self.first_nonfinite, step),
                                               self.first_nonfinite)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update itself on inf/NaN, lowers the scale
            self.scaler.update()
        elif config.nonfinite == "skip" and not torch.isfinite(self.grad_norm).item():
            self.skipped += 1
            self.log.write({"step": step, "split": "train", "nonfinite": "skipped",
                            "skipped": self.skipped})
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def log_train(self) -> None:
        """Log the mean training loss (over ranks) and throughput since the last log."""
        mean_loss = self.parallel.sum(self.window_loss).item() / max(self.window_units, 1)
        self.check_finite()
        elapsed = time.perf_counter() - self.window_start
        record = {"step": self.steps_done, "split": "train", "loss": mean_loss,
                  "ppl": math.exp(min(mean_loss, 50.0)), "lr": self.lr,
                  "grad_norm": float(self.grad_norm), "units_per_s": self.window_units / elapsed,
                  "epoch": self.batches.epoch, "skipped": self.skips(),
                  "seconds": time.perf_counter() - self.train_start,
                  "cpu_seconds": time.process_time() - self.cpu_start}
        self.log.write(record)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{mean_loss:.3f}", ppl=f"{record['ppl']:.1f}",
                                      lr=f"{self.lr:.2e}", tok_s=f"{record['units_per_s']:.0f}",
                                      refresh=False)
        self.window_loss.zero_()
        self.window_units = 0
        self.window_start = time.perf_counter()

    def skips(self) -> int:
        """Updates skipped for an inf/NaN gradient: by ``nonfinite="skip"``, or by fp16's
        gradient scaler (one sync)."""
        return self.skipped + int(self.scaler_skips)

    def check_finite(self) -> None:
        """nonfinite="raise": stop before anything is written after a bad step (one sync)."""
        if self.config.nonfinite != "raise":
            return
        ranks_hit = int(self.parallel.sum((self.first_nonfinite > 0).to(torch.float64)).item())
        if ranks_hit:
            where = int(self.first_nonfinite.item())
            raise ValueError(
                f"non-finite training loss or gradient at step {where}" if where else
                f"non-finite training loss or gradient on another rank (before step "
                f"{self.steps_done})")

    def evaluate(self) -> dict[str, float]:
        """Validation metrics of the current weights, logged; publishes the weights as the run's
        model when they are the best so far on ``config.best_metric``."""
        self.check_finite()
        metric = self.config.best_metric
        metrics = evaluate_model(self.parallel.eval_model, self.task, metric)
        self.log.write({"step": self.steps_done, "split": "valid", **metrics})
        if metric is not None and is_better(metrics[metric], self.best, self.config.best_mode):
            self.best = metrics[metric]
            full_model = self.parallel.full_model()  # every rank: the metrics are the same
            if self.main:
                publish_weights(self.run_dir, full_model, f"best@{self.steps_done}", metrics)
        self.metrics, self.last_eval_step = metrics, self.steps_done
        return metrics

    def save(self) -> None:
        """Write the checkpoint of this step (rank 0; every rank joins the gathering of weights,
        optimizer state and RNG states) and delete those beyond ``config.keep_last``."""
        full_model = self.parallel.full_model()  # collectives under FSDP: every rank gets here
        optimizer_state = self.parallel.optimizer_state_dict(self.optimizer)
        rank_rng = self.parallel.gather_rng_states()
        self.last_save_step = self.steps_done
        if not self.main:
            return
        opt_tensors, opt_meta = optimizer_to_tensors(self.optimizer, state_dict=optimizer_state)
        rng_tensors, rng_meta = capture_rng()
        meta = {"format_version": FORMAT_VERSION, "epoch": self.batches.epoch,
                "batch_index": self.batches.index, "optimizer": opt_meta, "rng": rng_meta,
                "best": self.best, "skipped": self.skips(), "units": self.units_total,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                # A run killed after its last checkpoint resumes without evaluating (and logging)
                # that step a second time.
                "evaluated": self.last_eval_step == self.steps_done, "metrics": self.metrics}
        write_checkpoint(self.checkpoint_dir, self.steps_done, full_model,
                         {**opt_tensors, **rng_tensors, **rank_rng}, meta)
        if self.config.keep_last:
            for old in list_checkpoints(self.checkpoint_dir)[:-self.config.keep_last]:
                remove_checkpoint(old)

    def finish(self) -> dict[str, float]:
        """Evaluate and save the last step if not done yet, average the last checkpoints
        (``average_last``), publish the final weights if no better ones were, complete run.json."""
        if self.progress is not None:
            self.progress.close()
        self.check_finite()
        step = self.steps_done
        if self.last_eval_step != step:
            self.evaluate()
        if self.last_save_step != step and not self.parallel.agree(
                (self.checkpoint_dir / f"step-{step}").is_dir()):
            self.save()
        final_model = self.parallel.full_model()  # the plain module; gathered to rank 0 under FSDP
        averaged = bool(self.config.average_last) and self._publish_average(final_model)
        if self.main:
            if not averaged and (self.config.best_metric is None
                                 or not (self.run_dir / WEIGHTS_FILE).is_file()):
                publish_weights(self.run_dir, final_model, f"final@{step}", self.metrics)
            update_run_info(self.run_dir, {"final_metrics": self.metrics, "steps_done": step,
                                           "best": self.best})
        return {**self.metrics, "step": step}

    def _publish_average(self, final_model: nn.Module) -> bool:
        """Evaluate the mean of the last ``average_last`` checkpoints (paper 6.1); publish it if it
        beats the best weights, or with no ``best_metric`` (the paper's model); return whether it
        was. The models go back to the final weights, the last checkpoint's. Under FSDP every rank
        joins (the average is evaluated sharded, as every evaluation is); else rank 0 alone."""
        if not (self.main or self.parallel.strategy == "fsdp"):
            return False
        recent, final, averaged = [], None, None
        if self.main:  # rank 0 reads the checkpoints; under FSDP the others get their shards
            recent = list_checkpoints(self.checkpoint_dir)[-self.config.average_last:]
            if len(recent) < self.config.average_last:  # save_every 0, a short or timed run
                warnings.warn(f"average_last={self.config.average_last}: the run has only "
                              f"{len(recent)} checkpoint(s) to average (save_every="
                              f"{self.config.save_every}, {self.steps_done} steps)",
                              RuntimeWarning, stacklevel=2)
            final = read_tensors(recent[-1] / "model.safetensors")  # this step: finish saved it
            averaged = average_checkpoints(recent)
        self.parallel.load_full_weights(averaged, source="checkpoint average")
        metric = self.config.best_metric
        metrics = evaluate_model(self.parallel.eval_model, self.task, metric)
        better = metric is None or is_better(metrics[metric], self.best, self.config.best_mode)
        if better:
            self.best = metrics.get(metric) if metric else None
            self.metrics = metrics
        if self.main:
            self.log.write({"step": self.steps_done, "split": "valid_averaged",
                            "checkpoints": len(recent), **metrics})
            if better:  # rank 0's final_model holds the average now
                publish_weights(self.run_dir, final_model,
                                f"average of {len(recent)}@{self.steps_done}", metrics)
        self.parallel.load_full_weights(final, source="final weights")
        return better

    def close(self) -> None:
        """Close the progress bar and the log (also after an error)."""
        if self.progress is not None:
            self.progress.close()
        self.log.close()
