"""Peak memory of `aiayn train lm` and `aiayn evaluate` on a large text: the corpus must not have to
fit in memory (token files, memory-mapped; `aiayn.data.token_files`).

The text is the bundled Shakespeare repeated ``--repeat`` times (80: 92.7 MB). Each row is one fresh
process of the real command line, timed whole; its peak resident set size is the child's
``ru_maxrss`` (Linux counts the parent's resident set at the fork in it: this script imports
neither torch nor the text until the rows are measured). Rows:

- ``train lm`` for 10 steps with characters (the default vocabulary) and with ``--tokenizer bpe``
  (learning the BPE and encoding included), on the large text and on the bundled 1.16 MB one (the
  floor: torch, the model and the optimizer);
- ``evaluate --split valid`` of the character run on the large text.

    python3 benchmarks/lm_large_text_memory.py [--repeat 80] [--rows char bpe ...] [--out FILE]

The result lands in benchmarks/results/lm_large_text_memory.json (``--out``), with the commands.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "shakespeare_tiny.txt.gz"
RESULT = ROOT / "benchmarks" / "results" / "lm_large_text_memory.json"
TRAIN = ["--steps", "10", "--eval-every", "10", "--save-every", "10", "--valid-fraction", "0.001",
         "--threads", "2", "--no-progress"]
ROWS = ("char", "bpe", "char-small", "bpe-small", "evaluate-char")


def commands(row: str, big: Path, small: Path, runs: Path) -> list[list[str]]:
    """The command lines of one row (the last one is measured; evaluate needs its run first)."""
    aiayn = [sys.executable, "-m", "aiayn"]
    text = small if row.endswith("-small") else big
    kind = row.removesuffix("-small").removeprefix("evaluate-")
    run = runs / row
    train = [*aiayn, "train", "lm", "--data", str(text), "--out", str(run), *TRAIN]
    if kind == "bpe":
        train += ["--tokenizer", "bpe"]
    if row.startswith("evaluate-"):
        return [train, [*aiayn, "evaluate", str(run), "--data", str(text), "--split", "valid",
                        "--threads", "2"]]
    return [train]


def measure(argv: list[str]) -> dict[str, float]:
    """Run ``argv`` in a fresh process; its wall time and peak resident set size."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    output = (process.stdout.read() + process.stderr.read()).decode("utf-8", "replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{output[-2000:]}")
    return {"seconds": round(seconds, 2), "peak_mb": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=80, help="copies of the bundled text")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aiayn-lm-memory-") as scratch:
        scratch = Path(scratch)
        small, big = scratch / "small.txt", scratch / "big.txt"
        text = gzip.open(DATA, "rt", encoding="utf-8").read()
        small.write_text(text, encoding="utf-8")
        with open(big, "w", encoding="utf-8") as out:
            for _ in range(args.repeat):
                out.write(text)
        del text
        rows = {}
        for row in args.rows:
            steps = commands(row, big, small, scratch / "runs")
            for argv in steps[:-1]:
                measure(argv)
            rows[row] = {**measure(steps[-1]),
                         "command": " ".join(steps[-1][2:]).replace(str(scratch), "$TMP")}
            print(row, rows[row], flush=True)
        import torch  # only now: see the module docstring
        from common import cpu_name

        result = {
            "text_mb": {"big": round(big.stat().st_size / 1e6, 1),
                        "small": round(small.stat().st_size / 1e6, 2)},
            "rows": rows,
            "command": "python3 benchmarks/lm_large_text_memory.py " + " ".join(sys.argv[1:]),
            "machine": f"{os.cpu_count()} cores, {cpu_name()}",
            "torch": torch.__version__,
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
