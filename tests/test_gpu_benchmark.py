"""The GPU benchmark (benchmarks/gpu.py) and the script a lent GPU runs (benchmarks/gpu_checks.sh),
run on the CPU at tiny shapes: every row is built, timed and written, the sides holding the same
weights agree, and asking for CUDA where there is none is a clear error. No timing assertions."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import script_helpers as scripts
import torch
from hf_helpers import needs_hf_sdpa

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu.py"


def _start(*arguments) -> subprocess.Popen:
    return scripts.start([SCRIPT, *arguments], env={**os.environ, "PYTHONPATH": str(REPO / "src")})


def _finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    return scripts.finish(process, timeout=900)


def _run(*arguments):
    return _finish(_start(*arguments))


TINY_RUN = "test_tiny_run_on_the_cpu_writes_every_row"
PROFILE_RUN = "test_profile_records_what_each_side_runs"


@pytest.fixture(scope="module")
def cpu_runs(request, tmp_path_factory):
    """The two tests' ``--device cpu --tiny`` runs (test name -> (process, its --out)), started
    together when the first of them is requested: they are independent fresh interpreters, so
    they run side by side. Only the runs of selected tests start; under pytest-xdist both tests
    are in one group (``--dist loadgroup``), so one worker starts them once."""
    selected = {item.name for item in request.session.items}
    arguments = {TINY_RUN: ["--device", "cpu", "--tiny", "--rounds", "1"],
                 PROFILE_RUN: ["--device", "cpu", "--tiny", "--rounds", "1", "--only", "greedy1",
                               "--profile"]}
    runs = {}
    for name, argv in arguments.items():
        if name in selected:
            out = tmp_path_factory.mktemp(name) / "gpu.json"
            runs[name] = (_start(*argv, "--out", str(out)), out)
    yield runs
    for process, _ in runs.values():
        if process.poll() is None:
            scripts.stop(process)


@needs_hf_sdpa("GPT2LMHeadModel", "MarianMTModel", "BertModel")
@pytest.mark.slow
@pytest.mark.xdist_group("gpu_cpu_runs")
def test_tiny_run_on_the_cpu_writes_every_row(cpu_runs):
    process, out = cpu_runs[TINY_RUN]  # --device cpu --tiny --rounds 1 --out OUT
    completed = _finish(process)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(row["benchmark"], row["ours"], row["peer"]): row for row in result["rows"]}
    assert set(rows) == {
        ("lm_train", "aiayn", "nanogpt"), ("lm_train", "aiayn+compile", "nanogpt+compile"),
        ("lm_train", "aiayn+compile", "nanogpt"),
        ("greedy1", "aiayn", "hf"), ("greedy1", "aiayn+graphs", "hf"),
        ("greedy1", "aiayn+engine", "hf"), ("greedy8", "aiayn", "hf"),
        ("greedy8", "aiayn+engine", "hf"), ("sample8", "aiayn+engine", "hf"),
        ("beam", "aiayn", "hf"), ("beam", "aiayn+graphs", "hf"), ("beam", "aiayn+engine", "hf"),
        ("greedy_mt", "aiayn", "hf"), ("greedy_mt", "aiayn+graphs", "hf"),
        ("seq2seq_train", "aiayn<-torch.nn", "torch.nn"), ("seq2seq_train", "aiayn<-marian", "marian"),
        ("encoder", "aiayn", "hf")}
    for row in result["rows"]:
        assert row["ours_value"] > 0 and row["peer_value"] > 0
        assert row["ratio"] == pytest.approx(row["ours_value"] / row["peer_value"])
    # aiayn holds nanoGPT's weights: the same first loss (bf16 autocast on both sides).
    lm = rows[("lm_train", "aiayn", "nanogpt")]
    assert lm["ours_mfu"] > 0
    assert lm["ours_first_loss"] == pytest.approx(lm["peer_first_loss"], abs=0.02)
    compiled = rows[("lm_train", "aiayn+compile", "nanogpt+compile")]
    assert compiled["ours_first_loss"] == pytest.approx(compiled["peer_first_loss"], abs=0.02)
    # aiayn holds HF GPT-2's weights: the same greedy tokens up to bf16 near-ties.
    assert rows[("greedy1", "aiayn", "hf")]["same_tokens"] >= 0.9
    assert rows[("greedy8", "aiayn+engine", "hf")]["same_tokens"] >= 0.9
    assert result["finished"] is True and not result["failed_rows"]
    assert result["command"].startswith("python3 benchmarks/gpu.py --device cpu --tiny")


def test_asking_for_cuda_without_one_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    completed = _run("--out", str(tmp_path / "x.json"))
    assert completed.returncode == 2
    assert "no CUDA device here" in completed.stderr


@needs_hf_sdpa("GPT2LMHeadModel", "MarianMTModel", "BertModel")
@pytest.mark.slow
@pytest.mark.xdist_group("gpu_cpu_runs")
def test_profile_records_what_each_side_runs(cpu_runs):
    """--profile: for both sides of a row, the wall and busy time of one call, its launches and the
    top kernels (on the CPU: operators), each with a count and a time."""
    process, out = cpu_runs[PROFILE_RUN]  # --device cpu --tiny --rounds 1 --only greedy1 --profile
    completed = _finish(process)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].endswith("--only greedy1 --profile --out " + str(out))
    rows = result["rows"]
    assert len(rows) == 3
    for row in rows:
        for side in ("ours_profile", "peer_profile"):
            profile = row[side]
            assert 0 < profile["busy_ms"] and 0 < profile["wall_ms"] and profile["launches"] > 0
            assert profile["top"] and all(k["count"] > 0 and k["ms"] >= 0 for k in profile["top"])
            assert [k["ms"] for k in profile["top"]] == sorted(
                (k["ms"] for k in profile["top"]), reverse=True)
    assert "aiayn+engine: wall" in completed.stdout
