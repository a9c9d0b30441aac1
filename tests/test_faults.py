"""Faults: a run killed (SIGKILL) at random points resumes to bit-identical weights, a full disk or
a read-only run directory is a clear error that loses nothing, a non-finite loss is skipped or stops
the run with its step, never trained on.

The SIGKILL test runs ``python -m aiayn train lm`` in subprocesses through a small launcher that can
pause the writer just before a chosen rename (``os.rename``/``os.replace`` in
aiayn.training.checkpoint: everything written to the temporary name, nothing renamed yet), so that
one kill lands deliberately inside a checkpoint write; the others land at seeded-random times.
"""

from __future__ import annotations

import errno
import gzip
import json
import math
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aiayn import Transformer
from aiayn.cli import main as cli_main
from aiayn.training import train
from aiayn.training import checkpoint as checkpoint_module
from aiayn.training.checkpoint import list_checkpoints, read_checkpoint, read_tensors
from aiayn.training.run import load_run, read_run_info
from test_training import ReverseTask, tiny_config, training_config

# The bundled tiny Shakespeare (data/README.md); the runs here train on its first 3000 characters.
SHAKESPEARE = Path(__file__).resolve().parents[1] / "data" / "shakespeare_tiny.txt.gz"


def opening_text(chars: int = 3000) -> str:
    with gzip.open(SHAKESPEARE, "rt", encoding="utf-8") as handle:
        return handle.read(chars)

# A launcher for `python -m aiayn`: deterministic algorithms, and (FAULT_PAUSE=ops:prefix:index)
# a pause before the index-th rename/replace (0-based) whose target name starts with prefix, after
# writing what happens into FAULT_MARKER; the test kills the process while it waits.
LAUNCHER = r'''
import os, runpy, sys, time
from pathlib import Path

import torch

torch.use_deterministic_algorithms(True)
pause = os.environ.get("FAULT_PAUSE")
if pause:
    import aiayn.training.checkpoint as checkpoint

    ops, prefix, index = pause.split(":")
    seen = [0]

    class PausingOs:
        def __getattr__(self, name):
            return getattr(os, name)

        def _maybe_pause(self, op, dst):
            if op in ops.split(",") and Path(dst).name.startswith(prefix):
                if seen[0] == int(index):
                    Path(os.environ["FAULT_MARKER"]).write_text(f"{op} {dst}")
                    time.sleep(600)
                seen[0] += 1

        def rename(self, src, dst):
            self._maybe_pause("rename", dst)
            os.rename(src, dst)

        def replace(self, src, dst):
            self._maybe_pause("replace", dst)
            os.replace(src, dst)

    checkpoint.os = PausingOs()
sys.argv = ["aiayn", *sys.argv[1:]]
runpy.run_module("aiayn", run_name="__main__", alter_sys=True)
'''


def lm_command(text: Path, run_dir: Path) -> list[str]:
    """A tiny character LM (dropout on, so the RNG state must resume exactly) with frequent
    checkpoints, evaluations (best weights published) and old-checkpoint deletions."""
    return ["train", "lm", "--data", str(text), "--out", str(run_dir), "--preset", "tiny",
            "--set", "d_model=16", "--set", "d_ff=32", "--set", "n_heads=2",
            "--set", "max_length=16", "--set", "dropout=0.1", "--block-size", "16",
            "--batch-size", "4", "--steps", "30", "--warmup", "5", "--save-every", "4",
            "--eval-every", "6", "--log-every", "1", "--keep-last", "3", "--threads", "1",
            "--device", "cpu", "--no-progress"]


def logged_steps(run_dir: Path) -> int:
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("split") == "train":
            steps.append(record["step"])
    return max(steps)


def check_after_kill(run_dir: Path) -> None:
    """What a kill may leave: finished checkpoints that all load, temporaries (.*.tmp) that
    nothing accepts, and nothing else."""
    checkpoints = run_dir / "checkpoints"
    if not checkpoints.is_dir():
        return
    listed = list_checkpoints(checkpoints)
    for child in checkpoints.iterdir():
        assert child in listed or (child.name.startswith(".") and child.name.endswith(".tmp")), \
            child
    for path in listed:
        _, meta, _ = read_checkpoint(path)  # checksums verified
        assert f"step-{meta['step']}" == path.name
        loaded = load_run(run_dir, weights=path, load_assets=False)  # every tensor, right shape
        assert all(torch.isfinite(p).all() for p in loaded.model.parameters())
    if listed:
        read_run_info(run_dir)
        if (run_dir / "model.safetensors").is_file():
            load_run(run_dir, load_assets=False)  # the published weights match run.json's sha


def tensors_equal(a: Path, b: Path) -> None:
    first, second = read_tensors(a), read_tensors(b)
    assert sorted(first) == sorted(second)
    for name in first:
        assert torch.equal(first[name], second[name]), f"{a.name}: {name} differs"


@pytest.mark.slow
def test_sigkill_at_random_points_resumes_to_bit_identical_weights(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text(opening_text(), encoding="utf-8")
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONHASHSEED": "0"}

    def start(run_dir: Path, pause: str | None = None) -> subprocess.Popen:
        extra = {"FAULT_PAUSE": pause, "FAULT_MARKER": str(tmp_path / "marker")} if pause else {}
        return subprocess.Popen([sys.executable, str(launcher), *lm_command(text, run_dir)],
                                env={**env, **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    reference = start(tmp_path / "reference")  # uninterrupted, alongside the killed one
    killed = tmp_path / "killed"
    rng = random.Random(20261123)
    # Deliberate kills first (the run is long enough to reach them), then seeded-random ones:
    # ("pause", ops:prefix:index) stops just before that rename; ("time", steps) kills a random
    # fraction of a second after the log shows that many more steps.
    plan = [("pause", f"rename:step-:{rng.randrange(2)}"),  # checkpoint in temp dir, not renamed
            ("time", rng.randint(2, 5)),
            ("pause", "rename:.step-:0"),  # keep_last deleting an old checkpoint
            ("pause", f"rename,replace::{rng.randrange(2, 12)}")]  # any atomic write
    kills = []
    for kind, where in plan:
        marker = tmp_path / "marker"
        marker.unlink(missing_ok=True)
        start_step = logged_steps(killed)
        process = start(killed, where if kind == "pause" else None)
        delay = rng.uniform(0.0, 0.3)
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if kind == "pause" and marker.is_file():
                break
            if kind == "time" and logged_steps(killed) >= start_step + where:
                time.sleep(delay)
                break
            time.sleep(0.02)
        if process.poll() is not None:  # finished before the kill point: nothing left to kill
            assert process.returncode == 0, process.stderr.read()
            break
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills.append((kind, marker.read_text() if kind == "pause" else logged_steps(killed)))
        check_after_kill(killed)
    else:
        process = start(killed)
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
    out, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err

    print("kills:", kills)
    assert len(kills) == len(plan), kills
    assert any(kind == "pause" and what.startswith("rename ") and Path(what.split()[1]).name
               .startswith("step-") for kind, what in kills), kills  # one inside a checkpoint write
    # Bit-identical: the published weights, every checkpoint kept, the loss curve, run.json's sums.
    assert (killed / "model.safetensors").read_bytes() == \
        (tmp_path / "reference" / "model.safetensors").read_bytes()
    tensors_equal(killed / "model.safetensors", tmp_path / "reference" / "model.safetensors")
    names = [p.name for p in list_checkpoints(killed / "checkpoints")]
    assert names == [p.name for p in list_checkpoints(tmp_path / "reference" / "checkpoints")]
    assert names[-1] == "step-30"
    for name in names:
        for file in ("model.safetensors", "trainer_state.safetensors"):
            tensors_equal(killed / "checkpoints" / name / file,
                          tmp_path / "reference" / "checkpoints" / name / file)
        assert json.loads((killed / "checkpoints" / name / "trainer_state.json").read_text()) == \
            json.loads((tmp_path / "reference" / "checkpoints" / name /
                        "trainer_state.json").read_text())

    def curve(run_dir):
        records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
        return [(r["step"], r["split"], r.get("loss")) for r in records]

    assert curve(killed) == curve(tmp_path / "reference")
    info, reference_info = read_run_info(killed), read_run_info(tmp_path / "reference")
    assert info["weights_sha256"] == reference_info["weights_sha256"]
    assert info["weights_source"] == reference_info["weights_source"]
    leftovers = [p for p in killed.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []  # the resumed run removed what the killed writers left


# --- disk full, read-only -------------------------------------------------------------------------
class FailingOs:
    """Stands in for ``os`` in aiayn.training.checkpoint: ``op`` raises OSError(code) when its
    path argument contains ``where`` (fsync, which takes a descriptor, fails while armed)."""

    def __init__(self, op: str, code: int, where: str):
        self.op, self.code, self.where = op, code, where
        self.armed = False

    def __getattr__(self, name):
        real = getattr(os, name)
        if name != self.op:
            return real

        def failing(*args, **kwargs):
            paths = [str(a) for a in args if isinstance(a, (str, Path))]
            if (name == "fsync" and self.armed) or any(self.where in p for p in paths):
                raise OSError(self.code, os.strerror(self.code))
            return real(*args, **kwargs)
        return failing


def first_run(tmp_path):
    run_dir = tmp_path / "run"
    train(Transformer(tiny_config()), ReverseTask(), training_config(steps=2, save_every=2),
          run_dir)
    step2 = run_dir / "checkpoints" / "step-2"
    return run_dir, step2, {p.name: p.read_bytes() for p in step2.iterdir()}


def assert_nothing_lost(run_dir, step2, before):
    assert {p.name: p.read_bytes() for p in step2.iterdir()} == before
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-2"]
    read_checkpoint(step2)
    load_run(run_dir, weights=step2, load_assets=False)
    assert [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("op, code, where, names", [
    # disk full while the checkpoint's files are flushed (delayed allocation reports it here)
    ("fsync", errno.ENOSPC, None, ("step-4", "No space left on device", "disk full")),
    # disk full while renaming the finished checkpoint into place
    ("rename", errno.ENOSPC, "step-4", ("step-4", "No space left on device", "disk full")),
    # the checkpoints directory became read-only: even the temporary directory cannot be made
    ("mkdir", errno.EROFS, "checkpoints", ("step-4", "Read-only file system", "read-only")),
    # the run directory is not writable: the first write (run.json) fails
    ("open", errno.EACCES, "run.json", ("run.json", "Permission denied", "read-only")),
])
def test_disk_full_or_read_only_is_a_clear_error_and_loses_nothing(tmp_path, monkeypatch, op,
                                                                   code, where, names):
    run_dir, step2, before = first_run(tmp_path)
    failing = FailingOs(op, code, where or "\0")
    monkeypatch.setattr(checkpoint_module, "os", failing)
    if op == "fsync":  # armed inside the checkpoint writer only (run.json is written first)
        real = checkpoint_module._write_checkpoint

        def armed(*args, **kwargs):
            failing.armed = True
            try:
                return real(*args, **kwargs)
            finally:
                failing.armed = False
        monkeypatch.setattr(checkpoint_module, "_write_checkpoint", armed)
    if op in ("mkdir", "open"):  # tempfile makes its files with its own os module
        monkeypatch.setattr("tempfile._os", failing)
    with pytest.raises(OSError) as caught:
        train(Transformer(tiny_config()), ReverseTask(), training_config(steps=4, save_every=2),
              run_dir)
    message = str(caught.value)
    assert caught.value.errno == code
    for word in names:
        assert word in message, message
    assert str(run_dir) in message
    monkeypatch.undo()
    assert_nothing_lost(run_dir, step2, before)


def test_file_size_limit_in_a_real_write_is_a_clear_cli_error(tmp_path):
    """The real writer (safetensors' Rust code) running into a file size limit (RLIMIT_FSIZE:
    what a full disk looks like to the writer, EFBIG instead of ENOSPC) in `aiayn train`."""
    text = tmp_path / "tiny.txt"
    text.write_text(opening_text(), encoding="utf-8")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "aiayn", *lm_command(text, run_dir)]
    command[command.index("--steps") + 1] = "8"
    first = subprocess.run([*command[:command.index("--steps") + 1], "4",
                            *command[command.index("--steps") + 2:]],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    step4 = run_dir / "checkpoints" / "step-4"
    before = {p.name: p.read_bytes() for p in step4.iterdir()}
    limit = (step4 / "model.safetensors").stat().st_size + 1000  # the trainer state is larger

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, do not kill the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    second = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    assert second.returncode == 1, second.stderr
    assert "Traceback" not in second.stderr
    assert "aiayn train: error: cannot write checkpoint" in second.stderr
    assert str(run_dir / "checkpoints" / "step-8") in second.stderr
    assert "File too large (disk full?)" in second.stderr
    assert {p.name: p.read_bytes() for p in step4.iterdir()} == before
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-4"]
    load_run(run_dir, weights=step4, load_assets=False)
    assert [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")] == []


# --- non-finite losses ----------------------------------------------------------------------------
class Poisoned(ReverseTask):
    """The loss of chosen optimizer steps (1-based; one micro-batch a step) becomes inf or NaN."""

    def __init__(self, bad_steps, value=float("nan"), **kwargs):
        super().__init__(**kwargs)
        self.bad_steps, self.value = set(bad_steps), value

    def loss(self, model, batch):
        loss = super().loss(model, batch)
        return loss * self.value if self.calls in self.bad_steps else loss


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_skip_leaves_the_weights_and_optimizer_unchanged_and_logs_it(tmp_path, value):
    config = training_config(steps=4, save_every=1, keep_last=0, log_every=2)
    model = Transformer(tiny_config())
    train(model, Poisoned({3}, value), config, tmp_path / "a")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    step = {n: tmp_path / "a" / "checkpoints" / f"step-{n}" for n in (2, 3, 4)}
    # The skipped step 3 changed nothing: weights and Adam moments as after step 2; step 4 moved.
    assert (step[3] / "model.safetensors").read_bytes() == \
        (step[2] / "model.safetensors").read_bytes()
    state2, state3 = (read_tensors(step[n] / "trainer_state.safetensors") for n in (2, 3))
    for name in state2:
        if name.startswith("optimizer/"):
            assert torch.equal(state2[name], state3[name]), name
    assert (step[4] / "model.safetensors").read_bytes() != \
        (step[3] / "model.safetensors").read_bytes()
    records = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert {"step": 3, "split": "train", "nonfinite": "skipped", "skipped": 1} in records
    assert [r["skipped"] for r in records if "loss" in r and r["split"] == "train"] == [0, 1]
    assert json.loads((step[4] / "trainer_state.json").read_text())["skipped"] == 1


def test_fp16_scaler_skips_are_counted_as_its_scale_shows_them(tmp_path):
    """fp16 autocast: the gradient scaler skips an update with an inf gradient (step 3's loss,
    and any early step whose scaled gradient overflows) and halves its scale each time (no growth
    within 2,000 steps); ``skipped`` in the log and in each checkpoint counts exactly those
    halvings, and a resumed run carries the count on."""
    config = training_config(steps=4, save_every=1, keep_last=0, log_every=2, autocast="fp16")
    torch.manual_seed(0)
    train(Transformer(tiny_config()), Poisoned({3}, float("inf")), config, tmp_path / "a")
    states = [json.loads((path / "trainer_state.json").read_text())
              for path in list_checkpoints(tmp_path / "a" / "checkpoints")]
    halvings = [round(math.log2(2.0 ** 16 / state["scaler"]["scale"])) for state in states]
    assert [state["skipped"] for state in states] == halvings
    assert halvings[2] == halvings[1] + 1  # step 3 at least
    records = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records if "loss" in r and r["split"] == "train"] == \
        [halvings[1], halvings[3]]
    # resumed from step 2 with step 4 poisoned: the count goes on from the checkpoint's
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for step in (3, 4):
        shutil.rmtree(tmp_path / "b" / "checkpoints" / f"step-{step}")
    torch.manual_seed(0)
    train(Transformer(tiny_config()), Poisoned({2}, float("inf")), config, tmp_path / "b")
    resumed = json.loads((tmp_path / "b" / "checkpoints" / "step-4" / "trainer_state.json")
                         .read_text())
    assert resumed["skipped"] == round(math.log2(2.0 ** 16 / resumed["scaler"]["scale"]))
    assert resumed["skipped"] >= halvings[1] + 1


def test_nonfinite_raise_names_the_step_and_writes_nothing_after_it(tmp_path):
    # log_every 10: the check still happens before the step-4 checkpoint would be written.
    config = training_config(steps=8, save_every=2, keep_last=0, log_every=10,
                             nonfinite="raise")
    with pytest.raises(ValueError, match="non-finite training loss or gradient at step 3$"):
        train(Transformer(tiny_config()), Poisoned({3}), config, tmp_path / "a")
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")] == ["step-2"]
    weights = read_tensors(tmp_path / "a" / "checkpoints" / "step-2" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not (tmp_path / "a" / "model.safetensors").exists()


class PoisonedGradient(ReverseTask):
    """At chosen steps the loss stays finite and the gradient is NaN: 0 * sqrt(0)' = 0 * inf."""

    def __init__(self, bad_steps, **kwargs):
        super().__init__(**kwargs)
        self.bad_steps = set(bad_steps)

    def loss(self, model, batch):
        loss = super().loss(model, batch)
        if self.calls in self.bad_steps:
            loss = loss + 0.0 * torch.sqrt(next(model.parameters()).sum() * 0.0)
        return loss


@pytest.mark.parametrize("steps, bad", [(5, 2), (3, 3)])
def test_nonfinite_raise_catches_a_nan_gradient_without_clipping_or_a_log_step(tmp_path, steps,
                                                                               bad):
    """No clipping and no log step at the bad step (log_every 10): "raise" still judges that
    step's gradient, names it, and saves nothing after it; on the last step too, where the
    finished run would otherwise publish NaN weights."""
    config = training_config(steps=steps, clip_norm=None, log_every=10, save_every=1,
                             keep_last=0, nonfinite="raise")
    with pytest.raises(ValueError, match=f"non-finite training loss or gradient at step {bad}$"):
        train(Transformer(tiny_config()), PoisonedGradient({bad}), config, tmp_path / "a")
    assert [p.name for p in list_checkpoints(tmp_path / "a" / "checkpoints")] == [
        f"step-{n}" for n in range(1, bad)]
    assert not (tmp_path / "a" / "model.safetensors").exists()


def test_the_last_train_record_has_its_own_steps_gradient_norm(tmp_path):
    """The record logged at the last step (not a multiple of log_every) holds that step's norm,
    as the run with "skip" (the same updates) has it, not the previous log step's."""
    norms = {}
    for policy in ("skip", "raise"):
        torch.manual_seed(0)
        train(Transformer(tiny_config()), ReverseTask(), training_config(
            steps=5, clip_norm=None, log_every=3, nonfinite=policy), tmp_path / policy)
        records = [json.loads(x) for x in (tmp_path / policy / "log.jsonl").read_text()
                   .splitlines()]
        norms[policy] = [(r["step"], r["grad_norm"]) for r in records if "grad_norm" in r]
    assert [step for step, _ in norms["raise"]] == [3, 5]
    assert norms["raise"] == norms["skip"]
    assert norms["raise"][0][1] != norms["raise"][1][1]


def test_nonfinite_policy_on_the_command_line(tmp_path, capsys):
    """--nonfinite is documented in --help; a learning rate that blows the weights up is stopped
    with the step (raise) or trained through with skipped updates (skip), never saved as NaN."""
    with pytest.raises(SystemExit):
        cli_main(["train", "lm", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--nonfinite {skip,raise}" in help_text and "non-finite" in help_text
    text = tmp_path / "tiny.txt"
    text.write_text(opening_text(), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        for policy in ("raise", "skip"):
            run_dir = tmp_path / policy
            command = lm_command(text, run_dir)
            command[command.index("--steps") + 1] = "6"
            rc = cli_main([*command, "--nonfinite", policy, "--schedule", "constant",
                           "--warmup", "0", "--lr", "1e30", "--weight-decay", "0",
                           "--set", "dropout=0.0"])
            err = capsys.readouterr().err
            if policy == "raise":
                assert rc == 1
                assert "aiayn train: error: non-finite training loss or gradient at step" in err
                assert list_checkpoints(run_dir / "checkpoints") == []
            else:
                assert rc == 0, err
                records = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
                assert any(r.get("nonfinite") == "skipped" for r in records)
                for path in list_checkpoints(run_dir / "checkpoints"):
                    tensors = read_tensors(path / "model.safetensors")
                    assert all(torch.isfinite(t).all() for t in tensors.values()), path
    finally:
        torch.set_num_threads(threads)


def test_cleaning_up_temporaries_leaves_a_users_own_dot_tmp_files(tmp_path):
    """Only names ``tempfile`` gives our temporaries (".<name>.<8 random>.tmp") are removed."""
    import tempfile

    from aiayn.training.checkpoint import remove_temporaries

    ours_file = Path(tempfile.mkstemp(dir=tmp_path, prefix=".model.safetensors.", suffix=".tmp")[1])
    ours_dir = Path(tempfile.mkdtemp(dir=tmp_path, prefix=".step-4.", suffix=".tmp"))
    (tmp_path / ".notes.tmp").mkdir()
    (tmp_path / ".notes.tmp" / "todo.txt").write_text("important")
    (tmp_path / ".draft.tmp").write_text("keep")
    assert sorted(remove_temporaries(tmp_path)) == sorted([ours_file, ours_dir])
    assert (tmp_path / ".notes.tmp" / "todo.txt").read_text() == "important"
    assert (tmp_path / ".draft.tmp").is_file()
