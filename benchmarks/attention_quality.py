"""Quality side by side: validation loss of the small LM preset on shakespeare_tiny.txt trained for
the same steps with dense (fused SDPA), linear and sparse attention.

Each kernel is one real run of the project's LM task (``aiayn train lm``): the same preset, recipe,
seed (so the same initial weights and the same batches) and steps; only ``attention`` differs (plus
the sparse pattern's window and stride, which must be shorter than the context to mean anything).
``sparse-bounded`` is ``sparse`` with the strided reach bounded to ``--stride-count`` strides
(``attention_stride_count``); at context 64 with stride 16 a query has at most 3 strided keys, so only a
count of 1 or 2 differs from ``sparse`` (a count >= 3 is the same pattern).
Validation loss is the task's exact figure over the whole last 10% of the text, read from each run's
``log.jsonl`` at every ``--eval-every`` steps.

Run:  python3 benchmarks/attention_quality.py --steps 2000 --eval-every 500 \
          --json benchmarks/results/attention_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "shakespeare_tiny.txt.gz"


def kernel_settings(kernel: str, args: argparse.Namespace) -> list[str]:
    """``--set`` overrides selecting one kernel; dense is the fused SDPA kernel."""
    settings = [f"attention={'sparse' if kernel == 'sparse-bounded' else kernel}"]
    if kernel in ("sparse", "sparse-bounded"):
        settings += [f"attention_pattern={args.pattern}", f"attention_window={args.window}",
                     f"attention_stride={args.stride}"]
    if kernel == "sparse-bounded":
        settings.append(f"attention_stride_count={args.stride_count}")
    if kernel == "linear":
        settings.append(f"attention_chunk_size={args.linear_chunk}")
    return [item for setting in settings for item in ("--set", setting)]


def train_one(kernel: str, args: argparse.Namespace, workdir: Path) -> dict:
    run_dir = workdir / kernel
    command = [sys.executable, "-m", "aiayn", "train", "lm", "--data", str(args.data),
               "--preset", args.preset, "--steps", str(args.steps), "--eval-every",
               str(args.eval_every), "--save-every", str(args.steps), "--seed", str(args.seed),
               "--out", str(run_dir), "--no-progress", "--no-resume",
               *kernel_settings(kernel, args), *args.extra]
    if args.threads:
        command += ["--threads", str(args.threads)]
    print("$ " + " ".join(command), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    history = [{"step": r["step"], "val_loss": r["loss"]} for r in records
               if r.get("split") == "valid"]
    if not history:
        raise RuntimeError(f"{run_dir}: the run logged no validation")
    for point in history:
        print(f"{kernel:>14} step {point['step']:5d}  val {point['val_loss']:.4f}", flush=True)
    final = history[-1]["val_loss"]
    return {"attention": kernel, "history": history, "val_loss": final,
            "val_bits_per_char": final / math.log(2), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--preset", default="baby-gpt", help="LM preset (context = its max_length)")
    parser.add_argument("--kernels", nargs="+", default=["fused", "linear", "sparse"],
                        choices=["reference", "fused", "chunked", "linear", "sparse",
                                 "sparse-bounded"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--pattern", default="local+strided")
    parser.add_argument("--window", type=int, default=16, help="sparse: local window")
    parser.add_argument("--stride", type=int, default=16, help="sparse: stride")
    parser.add_argument("--stride-count", type=int, default=2,
                        help="sparse-bounded: strided keys at most this many strides away")
    parser.add_argument("--linear-chunk", type=int, default=64, help="linear: chunk of the prefix sum")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER,
                        help="after --: more `aiayn train lm` options, the same for every kernel")
    args = parser.parse_args()
    args.extra = [item for item in args.extra if item != "--"]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        results = [train_one(name, args, workdir) for name in args.kernels]
    steps = [point["step"] for point in results[0]["history"]]
    print("\nvalidation loss (nats/char, whole validation split) at equal steps")
    print(f"{'attention':>14} | " + " | ".join(f"{s:>7}" for s in steps) + " | bits/char | train s")
    for r in results:
        losses = {point["step"]: point["val_loss"] for point in r["history"]}
        cells = " | ".join(f"{losses[s]:7.4f}" if s in losses else f"{'-':>7}" for s in steps)
        print(f"{r['attention']:>14} | {cells} | {r['val_bits_per_char']:9.3f} | {r['seconds']:7.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {key: (str(value) if isinstance(value, Path) else value)
                    for key, value in vars(args).items()}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"command": " ".join(sys.argv), "settings": settings,
                                   "results": results}, indent=2) + "\n")
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
