"""TensorBoard logging (``TrainingConfig.tensorboard`` / ``--tensorboard``): the same metrics as
log.jsonl, one value per step after a kill and resume, and a clear error without the package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from aiayn.cli import build_parser  # noqa: E402
from aiayn.commands.train import training_config_from_args  # noqa: E402
from test_training import ReverseTask, run, training_config  # noqa: E402


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir / "tensorboard"), purge_orphaned_data=True)
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def logged(run_dir: Path, split: str, key: str) -> list[tuple[int, float]]:
    records = map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
    return [(r["step"], r[key]) for r in records if r["split"] == split and key in r]


def assert_same_series(tensorboard_series, jsonl_series):
    assert [step for step, _ in tensorboard_series] == [step for step, _ in jsonl_series]
    # TensorBoard stores scalars as float32.
    torch.testing.assert_close(torch.tensor([v for _, v in tensorboard_series]),
                               torch.tensor([v for _, v in jsonl_series], dtype=torch.float32))


def test_every_logged_metric_is_a_tensorboard_scalar(tmp_path):
    config = training_config(steps=6, eval_every=3, tensorboard=True)
    run(tmp_path, "run", ReverseTask(), config)
    series = scalars(tmp_path / "run")
    for key in ("loss", "ppl", "lr", "grad_norm", "units_per_s"):
        assert_same_series(series[f"train/{key}"], logged(tmp_path / "run", "train", key))
    assert_same_series(series["valid/loss"], logged(tmp_path / "run", "valid", "loss"))
    assert [step for step, _ in series["valid/loss"]] == [3, 6]


def test_no_tensorboard_directory_by_default(tmp_path):
    run(tmp_path, "run", ReverseTask(), training_config(steps=2))
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_killed_and_resumed_run_has_one_value_per_step_equal_to_an_uninterrupted_run(tmp_path):
    config = training_config(steps=10, save_every=3, tensorboard=True)
    run(tmp_path, "full", ReverseTask(), config)
    with pytest.raises(KeyboardInterrupt):  # killed at step 8: steps 7 and 8 were logged
        run(tmp_path, "killed", ReverseTask(fail_at=9), config)
    assert [step for step, _ in scalars(tmp_path / "killed")["train/loss"]][-1] == 8
    run(tmp_path, "killed", ReverseTask(), config)  # resumes from step 6
    resumed, full = scalars(tmp_path / "killed"), scalars(tmp_path / "full")
    assert [step for step, _ in resumed["train/loss"]] == list(range(1, 11))
    assert_same_series(resumed["train/loss"], full["train/loss"])


def test_missing_package_is_a_clear_error_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    with pytest.raises(ValueError, match=r"pip install 'aiayn\[tensorboard\]'"):
        run(tmp_path, "run", ReverseTask(), training_config(steps=2, tensorboard=True))
    assert not (tmp_path / "run" / "checkpoints").exists() or \
        not any((tmp_path / "run" / "checkpoints").iterdir())


def test_cli_flag_reaches_the_training_config():
    argv = ["train", "lm", "--data", "x.txt", "--out", "run", "--lr", "0.001"]
    for extra, expected in (([], False), (["--tensorboard"], True)):
        args = build_parser().parse_args(argv + extra)
        assert training_config_from_args(args, d_model=64).tensorboard is expected
