"""Characters or subwords for the language model of the bundled Shakespeare: the default recipe
(`aiayn train lm`, preset char-gpt, 2000 steps of 12 blocks of 64 tokens) with the character
vocabulary and with byte-level BPE vocabularies of several sizes (`--tokenizer bpe --vocab-size N`).

Compared in bits per character on the whole validation split (the same last 10 % of the characters
for every vocabulary: the summed loss in bits over the characters predicted), so vocabularies that
cut the text differently are scored on the same text. A subword block of 64 tokens covers more
text than 64 characters, and the larger output layer costs time: the training seconds are recorded.

    python3 benchmarks/lm_vocabularies.py [--vocab-sizes 512 2048 8192] [--seeds 0] [--parallel 2]
        [--steps N] [--out FILE]

Runs go through the real command line, ``--parallel`` at a time on one thread each; the result
lands in benchmarks/results/lm_vocabularies.json (``--out``). ``--steps N`` shortens every run
(validation at its end only), for a quick check.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = "data/shakespeare_tiny.txt.gz"
RESULT = ROOT / "benchmarks" / "results" / "lm_vocabularies.json"


def command(vocabulary: str, seed: int, out: str, steps: int | None = None) -> list[str]:
    argv = ["aiayn", "train", "lm", "--data", DATA, "--out", out, "--seed", str(seed),
            "--threads", "1", "--no-progress"]
    if steps is not None:
        argv += ["--steps", str(steps), "--eval-every", str(steps), "--save-every", "0"]
    if vocabulary != "char":
        argv += ["--tokenizer", "bpe", "--vocab-size", vocabulary]
    return argv


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    valid = [{"step": r["step"], "loss": round(r["loss"], 4), "bpc": round(r["bpc"], 4),
              **({"bits_per_token": round(r["bits_per_token"], 4)} if "bits_per_token" in r
                 else {})}
             for r in rows if r.get("split") == "valid"]
    seconds = max(r["seconds"] for r in rows if r.get("split") == "train")
    info = json.loads((run_dir / "run.json").read_text())
    tokens = run_dir / "tokens" / "tokens.json"
    extra = {}
    if tokens.is_file():
        counts = json.loads(tokens.read_text())
        extra = {"characters_per_token": round(
            (counts["train_characters"] + counts["valid_characters"])
            / (counts["train_tokens"] + counts["valid_tokens"]), 3)}
    return {"vocabulary_size": info["model_config"]["vocab_size"], **extra,
            "train_seconds": round(seconds, 1), "valid": valid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-sizes", nargs="+", default=["512", "2048", "8192"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="default: aiayn train lm's 2000")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    jobs = [(vocabulary, seed) for seed in args.seeds for vocabulary in ["char", *args.vocab_sizes]]
    results = {}  # by job
    with tempfile.TemporaryDirectory(prefix="aiayn-lm-vocab-") as scratch:
        running: list[tuple[tuple[str, int], str, subprocess.Popen]] = []
        pending = list(jobs)
        while pending or running:
            while pending and len(running) < args.parallel:
                job = pending.pop(0)
                out = str(Path(scratch) / f"{job[0]}-{job[1]}")
                argv = command(*job, out, args.steps)  # "aiayn ...": this Python's
                process = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                running.append((job, out, process))
            time.sleep(2)
            for entry in [entry for entry in running if entry[2].poll() is not None]:
                running.remove(entry)
                (vocabulary, seed), out, process = entry
                shown = " ".join(command(vocabulary, seed, "RUN", args.steps))
                if process.returncode:
                    sys.exit(f"{shown} failed:\n{process.stderr.read().decode()[-2000:]}")
                results[vocabulary, seed] = {
                    "vocabulary": "characters" if vocabulary == "char"
                    else f"byte-level BPE {vocabulary}", "seed": seed, "command": shown,
                    **summary(Path(out))}
                print(json.dumps(results[vocabulary, seed]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    args.out.write_text(json.dumps({
        "what": f"aiayn train lm defaults (preset char-gpt, {args.steps or 2000} steps, batch 12 x "
                f"64 tokens) on "
                f"{DATA}, characters vs byte-level BPE: validation bits per character over the "
                "whole last 10 % of the characters",
        "command": "python3 benchmarks/lm_vocabularies.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {args.parallel} runs at a time, "
                   "torch CPU threads 1 each",
        "torch": torch.__version__, "aiayn_commit": commit,
        "runs": [results[job] for job in jobs]}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
