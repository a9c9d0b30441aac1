"""Smoke test of benchmarks/gpu.py on the CPU (--tiny): every row is built, timed and written, the
sides agree on their outputs, and asking for CUDA where there is none is a clear error. No timing
assertions; on a machine with a GPU the same program is run by hand (docs/performance.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu.py"


def _run(*arguments):
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_tiny_run_on_the_cpu_writes_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    completed = _run("--device", "cpu", "--tiny", "--rounds", "1", "--no-memory", "--out", str(out))
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    pairs = [(row["benchmark"], row["ours"], row["peer"]) for row in result["rows"]]
    assert pairs == [
        ("lm train step (bf16 autocast)", "aiayn", "hf"),
        ("lm train step (bf16 autocast)", "aiayn", "nanogpt"),
        ("greedy generation (bf16), batch 1", "aiayn", "hf"),
        ("greedy generation (bf16), batch 8", "aiayn", "hf"),
        ("encoder inference (bf16)", "aiayn", "hf"),
    ]
    for row in result["rows"]:
        assert row["ours_value"] > 0 and row["peer_value"] > 0
        assert row["ratio"] == pytest.approx(row["ours_value"] / row["peer_value"])
    by_name = {row["benchmark"]: row for row in result["rows"]}
    assert by_name["lm train step (bf16 autocast)"]["ours_mfu"] > 0
    # The aiayn models hold the peers' weights: the same greedy tokens, the same hidden states up to
    # bf16 rounding.
    assert by_name["greedy generation (bf16), batch 1"]["same_tokens"] == 1.0
    assert by_name["greedy generation (bf16), batch 8"]["same_tokens"] >= 0.9
    assert by_name["encoder inference (bf16)"]["max_abs_difference"] < 0.1
    assert result["finished"] is True
    lm = [row for row in result["rows"] if row["peer"] == "hf" and "ours_first_loss" in row][0]
    assert lm["ours_first_loss"] == pytest.approx(lm["peer_first_loss"], abs=0.05)
    assert result["command"].startswith("python3 benchmarks/gpu.py --device cpu --tiny")


@pytest.mark.slow
def test_tiny_compiled_rows_run_on_the_cpu(tmp_path):
    """``--compile`` (aiayn's layers compiled, nanoGPT-style compiled whole): the rows a lent GPU's
    short run depends on are built, timed and saved, and the compiled step trains what eager does."""
    out = tmp_path / "gpu.json"
    completed = _run("--device", "cpu", "--tiny", "--compile", "--only", "lm_train", "--rounds", "1",
                     "--no-memory", "--out", str(out))
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["ours"], row["peer"]) for row in rows] == [
        ("aiayn", "hf"), ("aiayn", "nanogpt"), ("aiayn+compile", "hf"),
        ("aiayn+compile", "nanogpt+compile")]
    assert all(row["ours_value"] > 0 and row["peer_value"] > 0 for row in rows)
    assert rows[2]["ours_first_loss"] == pytest.approx(rows[0]["ours_first_loss"], abs=1e-3)


@pytest.mark.slow
def test_memory_subprocess_prints_the_peak_of_one_side():
    completed = _run("--memory", "aiayn", "--memory-row", "encoder", "--device", "cpu", "--tiny")
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert int(completed.stdout.strip().splitlines()[-1]) > 2 ** 20


def test_a_failing_row_is_recorded_and_the_other_rows_still_run(tmp_path, monkeypatch, capsys):
    """A (rarely lent) GPU's run must not lose every row to one broken row: the failure is printed
    and saved, the other rows are measured and saved, and the program then exits non-zero."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu

    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(gpu, "build_greedy", broken)
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit, match="rows that failed: greedy1"):
        gpu.main(["--device", "cpu", "--tiny", "--only", "greedy1", "encoder", "--rounds", "1",
                  "--no-memory", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["finished"] is True
    assert [row["benchmark"] for row in result["rows"]] == ["encoder inference (bf16)"]
    assert "planted failure" in result["failed_rows"]["greedy1"]
    assert "row greedy1 failed" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    completed = _run("--device", "cuda", "--tiny")
    assert completed.returncode != 0
    assert "no CUDA device here" in completed.stderr


@pytest.mark.slow
def test_gpu_profile_runs_on_the_cpu_and_its_loss_paths_agree(tmp_path):
    """benchmarks/gpu_profile.py --tiny: every side timed and profiled, the chunked loss gives the
    logits path's value, and both are compared with the float32 reference (on a CPU both chunked
    sides take the CPU path; the GPU path's own equivalence tests force it on the CPU:
    test_linear_cross_entropy.py)."""
    out = tmp_path / "profile.txt"
    completed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_profile.py"),
                                "--device", "cpu", "--tiny", "--rounds", "1", "--profile-steps", "1",
                                "--top", "3", "--out", str(out)],
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-2000:]
    text = out.read_text()
    for side in ("aiayn ", "aiayn-unaligned", "aiayn-logits", "aiayn-chunk4096", "nanogpt"):
        assert f"=== {side.strip()}: 1 steps" in text

    def losses(label):
        line = next(line for line in text.splitlines() if line.startswith(label + " loss: "))
        return [float(value) for value in line.split("loss: ")[1].split(";")[0].split(" / ")]

    ours, plain = losses("chunked vs logits (both bf16)")
    assert ours == pytest.approx(plain, abs=1e-4)
    for label in ("chunked (bf16) vs float32 reference", "logits (bf16) vs float32 reference"):
        bf16, reference = losses(label)
        assert bf16 == pytest.approx(reference, rel=1e-2)  # bf16's own rounding, not another loss
