"""The T5 text-to-text table of docs/t5.md: three `aiayn train text2text` runs of the same size and
wall clock (both tasks, translation only, classification only), each scored on the test splits.

    python3 benchmarks/t5_text2text.py [--time-limit 480] [--threads 2] [--out-dir runs/t5-table]
        [--results benchmarks/results/t5_text2text.json] [--limit N] [-- EXTRA TRAIN OPTIONS]

Runs one training at a time (the machine should be otherwise idle: the budget is wall clock), then
`aiayn evaluate RUN --data <the bundled files the run was trained on>` (beam 4, the default), and
writes each run's command, steps, training seconds and test scores to the results JSON as it goes.
Existing run directories are resumed by `aiayn train`, so give a fresh --out-dir for a new table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import cpu_name, save_results  # noqa: E402

DATA = {"translation": ROOT / "data" / "ddtp_en_de.tsv.gz",
        "classification": ROOT / "data" / "debian_sections_topical.tsv.gz"}
RUNS = {"both": ["translation", "classification"], "translation": ["translation"],
        "classification": ["classification"]}


def aiayn(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiayn", *args]


def last_json(text: str) -> dict:
    """The last line of a command's stdout that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON summary in the output:\n{text[-2000:]}")


def run(command: list[str]) -> str:
    """A command's stdout; on failure, exit naming the command with the end of its stderr."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=480.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default=str(ROOT / "runs" / "t5-table"))
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" /
                                                 "t5_text2text.json"))
    parser.add_argument("--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS))
    parser.add_argument("--limit", type=int, default=None,
                        help="score only the first N test examples of each task (`aiayn evaluate "
                             "--limit`; a quick check); default: every test example")
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="after --: more `aiayn train text2text` options for every run")
    args = parser.parse_args(argv)
    extra = [a for a in args.extra if a != "--"]
    import torch

    results: dict = {"command": shlex.join(["python3", "benchmarks/t5_text2text.py",
                                            *(argv if argv is not None else sys.argv[1:])]),
                     "machine": f"{cpu_name()}, {os.cpu_count()} cores",
                     "torch": torch.__version__, "runs": {}}
    for name in args.runs:
        tasks = RUNS[name]
        run_dir = Path(os.path.relpath(Path(args.out_dir) / name, ROOT))
        train = aiayn("train", "text2text", "--out", str(run_dir), "--tasks", *tasks,
                      "--time-limit", str(args.time_limit), "--threads", str(args.threads),
                      "--no-progress", *extra)
        start = time.perf_counter()
        summary = last_json(run(train))
        seconds = time.perf_counter() - start
        limit = ["--limit", str(args.limit)] if args.limit is not None else []
        evaluate = aiayn("evaluate", str(run_dir), *limit, "--data",
                         *(str(DATA[t].relative_to(ROOT)) for t in tasks))
        scores = json.loads(run(evaluate))
        results["runs"][name] = {
            "train": shlex.join(["aiayn", *train[3:]]),
            "evaluate": shlex.join(["aiayn", *evaluate[3:]]),
            "steps": summary["step"],
            "train_command_seconds": round(seconds, 1),  # data, tokenizer, training, evaluations
            "summary": summary,
            "test": {kind: {k: v for k, v in scores[kind].items() if k != "data"}
                     for kind in tasks},
        }
        save_results(Path(args.results), results)
        print(json.dumps({name: results["runs"][name]["test"],
                          "steps": results["runs"][name]["steps"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
