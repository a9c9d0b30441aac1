"""Run directories: what ``aiayn train`` writes and ``aiayn translate/evaluate`` read.

Layout::

    RUN_DIR/
      run.json               task name, format_version, model class + config, training config,
                             task assets description, metrics, SHA-256 of model.safetensors
      model.safetensors      weights for inference (best, averaged or final)
      checkpoints/step-N/    model.safetensors, trainer_state.safetensors, trainer_state.json
      log.jsonl              one JSON object per logged step / evaluation
      <assets>               whatever the task saves (tokenizer, labels)
"""

from __future__ import annotations

import importlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from aiayn.config import TransformerConfig
from aiayn.training.checkpoint import (atomic_write_json, list_checkpoints, read_checkpoint,
                                       save_weights)
from aiayn.training.config import TrainingConfig
from aiayn.training.weights import load_weights

FORMAT_VERSION = 1
RUN_FILE = "run.json"
WEIGHTS_FILE = "model.safetensors"
CHECKPOINT_DIR = "checkpoints"
LOG_FILE = "log.jsonl"
TENSORBOARD_DIR = "tensorboard"  # TensorBoard event files, with --tensorboard


@dataclass
class Run:
    """A trained run loaded for inference: model on CPU in eval mode plus the task's assets."""

    path: Path
    task: str
    model_config: TransformerConfig
    training_config: dict[str, Any]
    model: nn.Module
    assets: Any = None
    info: dict[str, Any] = field(default_factory=dict)  # the whole run.json
    weights: Path | None = None  # the file the weights came from


def qualified_name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def import_qualified(name: str, *, what: str, source: Path) -> Any:
    """Import ``module:qualname``; only aiayn's own classes (run.json is data, not code)."""
    module_name, _, qualname = name.partition(":")
    if not (module_name == "aiayn" or module_name.startswith("aiayn.")) or not qualname:
        raise ValueError(f"{source}: {what} {name!r} is not an aiayn class")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{source}: unknown {what} {name!r} ({error})") from None
    return obj


def read_run_info(run_dir: str | Path) -> dict[str, Any]:
    """run.json of ``run_dir``, checked: a directory, a run, a format this version reads."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise NotADirectoryError(f"{run_dir} is not a directory (expected a run directory made "
                                 f"by 'aiayn train')")
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise ValueError(f"{run_dir} is not an aiayn run directory (no {RUN_FILE}); make one "
                         f"with 'aiayn train'")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: corrupt run file ({error})") from None
    if not isinstance(info, dict) or not {"task", "format_version", "model_config"} <= set(info):
        raise ValueError(f"{path}: corrupt run file (needs task, format_version, model_config)")
    version = info["format_version"]
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{path}: run format version {version!r} is newer than this aiayn "
                         f"reads ({FORMAT_VERSION}); upgrade aiayn")
    return info


def check_task(run_dir: Path, task: str) -> dict[str, Any]:
    """``run_dir``'s run.json, after checking that it holds a run of ``task``."""
    info = read_run_info(run_dir)
    if info["task"] != task:
        raise ValueError(f"{run_dir} holds a run of task {info['task']!r}, not {task!r}")
    return info


def check_resumable(run_dir: Path, task: str, model_config: dict[str, Any],
                    training_config: dict[str, Any] | None = None) -> None:
    """Raise unless ``run_dir`` holds a run of ``task`` with this model config (to resume it) and,
    given ``training_config``, the same training settings (``check_same_training``)."""
    info = check_task(run_dir, task)
    # A run saved before a config field existed holds no value for it: compare both configs with
    # their defaults filled in, so such a run resumes (its value is the field's default).
    saved, now = (_with_defaults(TransformerConfig, config)
                  for config in (info["model_config"], model_config))
    if saved != now:
        changed = sorted(key for key, value in now.items() if saved.get(key) != value)
        raise ValueError(f"{run_dir} holds a run with another model config (differs in "
                         f"{', '.join(changed)}); resume with the same settings or use "
                         f"another directory")
    if training_config is not None:
        check_same_training(run_dir, info.get("training_config"), training_config)


def check_same_assets(run_dir: Path, task: Any) -> None:
    """Raise unless the files ``task.save_assets`` would write (vocabulary, labels, tokenizer,
    prefixes) are those ``run_dir`` holds: a run resumed on other data would otherwise keep its
    weights and silently give their ids other meanings (a character vocabulary or a label set of
    the same size but another order)."""
    with tempfile.TemporaryDirectory() as scratch:
        task.save_assets(Path(scratch))
        for made in sorted(Path(scratch).iterdir()):
            saved = Path(run_dir) / made.name
            if made.is_file() and saved.is_file() and saved.read_bytes() != made.read_bytes():
                raise ValueError(
                    f"{saved} differs from the one this data and these options give: the run was "
                    f"trained with another {made.name} (other data, labels or prefixes). Resume "
                    f"with the run's own data and options, or train into another directory")


# The training settings a resumed run may change: how long it runs, where, how fast and what it
# reports. Every other one (optimizer, its hyper-parameters, the schedule's shape, lr_scales,
# accumulation, clipping, seed, the metric that picks the best weights) shapes the steps still to
# come from the checkpoint's optimizer state and best value, so it must equal the run's own.
RESUME_MAY_CHANGE = frozenset({
    "steps", "eval_every", "save_every", "log_every", "keep_last", "average_last", "nonfinite",
    "progress", "device", "time_limit", "distributed", "activation_checkpointing", "compile",
    "tensorboard", "autocast"})
# The schedule's end follows ``steps`` (a cosine decays to the new end when a run is extended).
SCHEDULE_MAY_CHANGE = frozenset({"total"})


class TrainingSettingsChanged(ValueError):
    """A resume with training settings other than the run's; ``fields`` names those that differ."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


def check_same_training(run_dir: Path, saved: dict[str, Any] | None,
                        training_config: dict[str, Any]) -> None:
    """Raise unless ``training_config`` trains on as the run's saved one did: the two may differ
    only in ``RESUME_MAY_CHANGE`` (and the schedule's ``total``). A run.json without a training
    config (written before it was recorded) is not checked."""
    if not saved:
        return
    saved, now = (_with_defaults(TrainingConfig, c) for c in (saved, training_config))
    changed, fields = [], []
    for key in sorted(set(saved) | set(now)):
        if key in RESUME_MAY_CHANGE:
            continue
        before, after = saved.get(key), now.get(key)
        if key == "schedule" and isinstance(before, dict) and isinstance(after, dict):
            before, after = ({name: value for name, value in schedule.items()
                              if name not in SCHEDULE_MAY_CHANGE} for schedule in (before, after))
        if before != after:
            changed.append(f"{key} (the run's {before!r}, now {after!r})")
            fields.append(key)
    if changed:
        raise TrainingSettingsChanged(
            f"{run_dir} holds a run trained with other settings: {'; '.join(changed)}. Resume "
            f"with the run's own settings (run.json's training_config), train into another "
            f"directory, or start a new run from its weights with --init", fields)


def checkpoints_to_resume(run_dir: Path, task: Any, model_config: dict[str, Any], *,
                          resume: bool, training_config: dict[str, Any] | None = None
                          ) -> list[Path]:
    """``run_dir``'s checkpoints, oldest first, once checked that training may resume from them
    (``resume``, the same task and model config, the same task assets and, given
    ``training_config``, the same training settings: ``check_same_training``); [] for a fresh
    run."""
    checkpoints = list_checkpoints(Path(run_dir) / CHECKPOINT_DIR)
    if checkpoints and not resume:
        raise ValueError(f"{run_dir} already holds a run with checkpoints; resume it or choose "
                         f"another directory")
    if checkpoints:
        check_resumable(run_dir, task.name, model_config, training_config)
        check_same_assets(run_dir, task)
    return checkpoints


def published_metric(run_dir: Path, metric: str) -> float | None:
    """``metric`` of the weights the run published (run.json's ``weights_metrics``), if any."""
    try:
        value = (read_run_info(run_dir).get("weights_metrics") or {}).get(metric)
    except (OSError, ValueError):  # no run.json yet (killed before publishing anything)
        return None
    return value if isinstance(value, (int, float)) else None


def _with_defaults(config_class: Any, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as ``config_class.to_dict`` writes it, with the fields it lacks (a run saved
    before they existed) at their defaults; as written if this aiayn cannot read it."""
    try:
        return config_class.from_dict(config).to_dict()
    except (TypeError, ValueError):
        return dict(config)


def update_run_info(run_dir: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Merge ``updates`` into run.json (a None value removes its key) and rewrite it atomically."""
    path = run_dir / RUN_FILE
    info = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    info.update(updates)
    info = {key: value for key, value in info.items() if value is not None}
    atomic_write_json(path, info)
    return info


def publish_weights(run_dir: Path, model: nn.Module, source: str, metrics: dict[str, Any]) -> None:
    """Write RUN_DIR/model.safetensors; run.json's checksum is dropped first and set after, so a
    crash in between never leaves a checksum that does not match the file."""
    update_run_info(run_dir, {"weights_sha256": None})
    digest = save_weights(model, run_dir / WEIGHTS_FILE)
    update_run_info(run_dir, {"weights_sha256": digest, "weights_source": source,
                              "weights_metrics": metrics})


def load_run(run_dir: str | Path, *, task: str | None = None, weights: str | Path | None = None,
             load_assets: bool = True) -> Run:
    """Load a run for inference.

    Args:
        run_dir: a directory written by ``aiayn train``.
        task: the task the caller expects; another task's run is an error.
        weights: a weights file or checkpoint directory to use instead of the run's model (default:
            ``model.safetensors``, or the latest checkpoint of a run that has not finished).
        load_assets: also load the task's assets (tokenizer, ...).

    Raises:
        FileNotFoundError / NotADirectoryError: ``run_dir`` missing or a file.
        ValueError: not a run, a run of another task, newer format, corrupt or mismatched weights.
    """
    run_dir = Path(run_dir)
    info = read_run_info(run_dir)
    if task is not None and info["task"] != task:
        raise ValueError(f"{run_dir} is a run of task {info['task']!r}, not {task!r}")
    source = run_dir / RUN_FILE
    try:
        model_config = TransformerConfig.from_dict(info["model_config"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: bad model_config ({error})") from None
    model_class = import_qualified(info.get("model_class", ""), what="model class", source=source)
    model = model_class(model_config)
    sha256 = None
    if weights is not None:
        path = Path(weights)
        if path.is_dir():
            _, _, path = read_checkpoint(path)
    elif (run_dir / WEIGHTS_FILE).is_file():
        path = run_dir / WEIGHTS_FILE
        sha256 = info.get("weights_sha256")
    else:
        checkpoints = list_checkpoints(run_dir / CHECKPOINT_DIR)
        if not checkpoints:
            raise ValueError(f"{run_dir}: the run has no weights yet ({WEIGHTS_FILE} and "
                             f"checkpoints/ are missing)")
        _, _, path = read_checkpoint(checkpoints[-1])
    load_weights(model, path, sha256=sha256)
    model.eval()
    assets = None
    if load_assets and info.get("task_class"):
        task_class = import_qualified(info["task_class"], what="task class", source=source)
        assets = task_class.load_assets(run_dir)
    return Run(path=run_dir, task=info["task"], model_config=model_config,
               training_config=info.get("training_config", {}), model=model, assets=assets,
               info=info, weights=path)
