"""Smoke test of benchmarks/translation_vs_marian.py: a --quick run on a slice of the bundled corpus
writes a JSON with both sides' training and decoding results (no timing assertions)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_helpers import needs_hf_sdpa

pytest.importorskip("transformers")
pytest.importorskip("sacrebleu")

REPO = Path(__file__).resolve().parent.parent
SIDE_FIELDS = {"steps", "train_seconds", "source_tokens", "target_tokens", "tokens_per_s",
               "target_tokens_per_s", "train_loss_last", "valid_loss", "bleu_greedy", "bleu_beam4",
               "chrf_greedy", "chrf_beam4", "decoding"}


@needs_hf_sdpa("MarianMTModel")
@pytest.mark.slow
def test_quick_run_reports_both_sides(tmp_path):
    with gzip.open(REPO / "data" / "ddtp_en_de.tsv.gz", "rt", encoding="utf-8") as handle:
        lines = [next(handle) for _ in range(401)]  # header + 400 pairs, split column included
    data = tmp_path / "slice.tsv"
    data.write_text("".join(lines), encoding="utf-8")
    out = tmp_path / "result.json"
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "translation_vs_marian.py"), "--quick",
         "--data", str(data), "--out", str(out), "--threads", "1"],
        capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "ours/peer" in completed.stdout
    result = json.loads(out.read_text(encoding="utf-8"))
    assert isinstance(result["machine"]["cpu"], str) and result["machine"]["cpu"]  # the CPU model
    setup = result["setup"]
    assert setup["parameters"]["aiayn"] == setup["parameters"]["marian"] > 0
    assert setup["initial_logits_max_abs_diff"] < 1e-4  # one architecture, one set of weights
    assert setup["test_sentences"] > 0
    # Each library's own loss function: the same value on the same logits.
    losses = setup["initial_training_loss"]
    assert losses["aiayn"] == pytest.approx(losses["marian"], rel=1e-5)
    for side in ("aiayn", "marian"):
        report = result[side]
        assert SIDE_FIELDS <= set(report)
        assert report["steps"] >= 1 and report["target_tokens"] > 0
        assert 0 < report["target_tokens_per_s"] < report["tokens_per_s"]
        for decoder in ("aiayn.decoding", "hf.generate"):
            for mode in ("greedy", "beam4"):
                scores = report["decoding"][decoder][mode]
                assert 0.0 <= scores["bleu"] <= 100.0 and 0.0 <= scores["chrf"] <= 100.0
        # Greedy search under one set of conventions: both decoders give the same output.
        assert report["decoding"]["aiayn.decoding"]["greedy"] == {
            **report["decoding"]["hf.generate"]["greedy"],
            "seconds": report["decoding"]["aiayn.decoding"]["greedy"]["seconds"]}
    assert set(result["ratios_ours_over_peer"]) >= {"tokens_per_s", "bleu_greedy", "bleu_beam4"}
