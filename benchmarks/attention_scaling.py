"""How time and memory of one attention layer grow with the sequence length n, per kernel.

Measures the attention kernel itself (q, k, v -> output, forward + backward of ``out.square().sum()``,
causal, batch 1, 8 heads, head width 64, float32, CPU): the projections around it cost O(n) for every
kernel and would only blur the comparison. Kernels: dense ``reference`` (eq. 1 with a (T, S) matrix),
``fused`` (torch SDPA), ``chunked`` (exact, online softmax), ``linear`` (elu+1) and ``sparse``
(local+strided, window 128, stride 128) plus ``sparse-local`` (window 128 only) and ``sparse-bounded``
(local+strided with the strided reach bounded to ``--stride-count`` strides, default 16: 16 strided keys
back, up to 2048 positions; linear in n, see docs/efficient-attention.md). ``--kernels`` selects kernels;
on request, ``chunked-window`` and ``fused-window`` run the two exact kernels under a sliding window of
``--window`` (the kernels' ``band``: the chunked kernel's tiles within it, the fused kernel's blocks).

Every (kernel, n) runs in a fresh child process, so its peak memory is the child's own high-water mark
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``); we report it minus the child's resident size just
before the first forward (after torch import and input allocation), i.e. the extra memory the
attention needs. Children run kernel after kernel for each n (alternating), so background load hits all
kernels alike. Time is the child's CPU time (``time.process_time``, all threads) per pass, median of the
repeats: on a machine shared with other jobs wall time mostly measures the scheduler, CPU time the
work (wall time is recorded too). A configuration whose memory or CPU time, extrapolated from
the kernel's measured growth, would exceed ``--memory-limit-gib`` or ``--max-config-s`` is skipped and
reported as such (so the whole run stays within minutes on a shared 2-core machine).
The growth exponent is the least-squares slope of log(median time) and log(extra memory) on log n.

Run:  PYTHONPATH=src python3 benchmarks/attention_scaling.py --json benchmarks/results/attention_scaling.json
      PYTHONPATH=src python3 benchmarks/attention_scaling.py --kernels chunked chunked-window fused \
          fused-window --lengths 1024 2048 4096 8192 16384 --long \
          --json benchmarks/results/attention_scaling_window.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

KERNELS = ["reference", "fused", "chunked", "linear", "sparse", "sparse-local", "sparse-bounded"]
WINDOWED = ["chunked-window", "fused-window"]  # on request: the exact kernels under a window
HEADS, HEAD_DIM = 8, 64


def build_kernel(name: str, chunk_size: int, window: int, stride: int, stride_count: int):
    """The kernel ``name``, called as ``kernel(q, k, v, causal=True)``."""
    from functools import partial

    from aiayn.nn.attention.chunked import ChunkedAttention
    from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention
    from aiayn.nn.attention.linear import LinearAttention
    from aiayn.nn.attention.sparse import SparseAttention

    return {
        "reference": lambda: ReferenceAttention(),
        "fused": lambda: FusedAttention(),
        "chunked": lambda: ChunkedAttention(chunk_size),
        "linear": lambda: LinearAttention(64),
        "sparse": lambda: SparseAttention("local+strided", window, stride),
        "sparse-local": lambda: SparseAttention("local", window, stride),
        "sparse-bounded": lambda: SparseAttention("local+strided", window, stride, stride_count),
        "chunked-window": lambda: partial(ChunkedAttention(chunk_size), band=window),
        "fused-window": lambda: partial(FusedAttention(), band=window),
    }[name]()


def _resident_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def child(args: argparse.Namespace) -> None:
    """Time ``args.repeats`` forward+backward passes of one kernel at one n; print one JSON line."""
    import torch

    torch.manual_seed(0)
    # One thread: CPU time then counts work, not the spin-waits of a thread whose partner was
    # descheduled (the machine is shared), and every kernel gets the same single core.
    torch.set_num_threads(args.threads)
    kernel = build_kernel(args.kernel, args.chunk_size, args.window, args.stride, args.stride_count)
    shape = (1, HEADS, args.n, HEAD_DIM)  # (B, H, T, Dh)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    baseline = _resident_kib()

    def step() -> tuple[float, float]:
        start, start_cpu = time.perf_counter(), time.process_time()
        out = kernel(q, k, v, causal=True)
        out.square().sum().backward()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        q.grad = k.grad = v.grad = None
        return elapsed, cpu

    walls, cpus = [], []
    if args.warmup:
        step()
    began = time.process_time()
    for _ in range(args.repeats):
        wall, cpu = step()
        walls.append(wall)
        cpus.append(cpu)
        if time.process_time() - began > args.budget_s:
            break  # long configurations: fewer repeats rather than a benchmark of hours
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"kernel": args.kernel, "n": args.n, "times_s": cpus, "wall_s": walls,
                      "threads": torch.get_num_threads(),
                      "peak_rss_mib": peak / 1024, "extra_mib": (peak - baseline) / 1024}))


def run_child(kernel: str, n: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", "--kernel", kernel, "--n", str(n),
               "--repeats", str(args.repeats),
               "--budget-s", str(args.budget_s), "--chunk-size", str(args.chunk_size),
               "--window", str(args.window), "--stride", str(args.stride),
               "--stride-count", str(args.stride_count),
               "--threads", str(args.threads)]
    if n <= 2048:  # larger runs take seconds: first-call overheads are noise there
        command.append("--warmup")
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        return {"kernel": kernel, "n": n, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def fit_exponent(ns: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) on log(n)."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    numerator = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return numerator / sum((x - mean_x) ** 2 for x, _ in points)


def predicted_mib(rows: list[dict], n: int) -> float | None:
    """Extra memory at n extrapolated from the kernel's measured points (power law)."""
    measured = [r for r in rows if "extra_mib" in r and r["extra_mib"] > 0]
    if len(measured) < 2:
        return None
    ns, mib = [r["n"] for r in measured], [r["extra_mib"] for r in measured]
    exponent = fit_exponent(ns, mib)
    return mib[-1] * (n / ns[-1]) ** exponent


def report(rows: dict[str, list[dict]], lengths: list[int], long: list[int]) -> dict:
    """Print the table and return the fitted exponents per kernel (fitted on ``lengths`` only)."""
    summary = {}
    for name, results in rows.items():
        fitted = [r for r in results if "times_s" in r and not r.get("long")]
        ns = [r["n"] for r in fitted]
        summary[name] = {
            "time_exponent": fit_exponent(ns, [statistics.median(r["times_s"]) for r in fitted]),
            "wall_time_exponent": fit_exponent(ns, [statistics.median(r["wall_s"])
                                                    for r in fitted]),
            "memory_exponent": fit_exponent(ns, [r["extra_mib"] for r in fitted]),
            "fitted_on": ns,
        }
    print("\nforward+backward, causal, B=1, H=8, Dh=64, float32, CPU; median CPU seconds (all threads)"
          " / extra peak MiB; exponents: CPU time, memory, wall time")
    header = f"{'kernel':>14} | " + " | ".join(f"{n:>15}" for n in lengths + long)
    print(header + " | time exp | mem exp | wall exp")
    print("-" * len(header) + "-+----------+---------+---------")
    for name, results in rows.items():
        cells = {r["n"]: r for r in results}
        texts = []
        for n in lengths + long:
            r = cells.get(n)
            if r is None:
                texts.append(f"{'-':>15}")
            elif "times_s" in r:
                texts.append(f"{statistics.median(r['times_s']):6.2f}s {r['extra_mib']:6.0f}M")
            else:
                texts.append(f"{'skipped' if 'skipped' in r else 'failed':>15}")
        s = summary[name]
        fmt = (lambda x: f"{x:8.2f}" if x is not None else f"{'-':>8}")
        print(f"{name:>14} | " + " | ".join(texts) + f" | {fmt(s['time_exponent'])} | "
              f"{fmt(s['memory_exponent'])} | {fmt(s['wall_time_exponent'])}")
    return summary


LOG_LINE = re.compile(r"^\s*(\S+) n=\s*(\d+): (?:cpu\s+([\d.]+) s\s+wall\s+([\d.]+) s\s+extra\s+"
                      r"([\d.]+) MiB\s+\((\d+) runs\)|skipped, (.*))$")


def merge_logs(paths: list[Path], lengths: list[int], long: list[int], json_path: Path | None) -> None:
    """Rebuild the table from the printed lines of several runs (e.g. one per range of n, run side
    by side to fit a deadline); each line is one measured median, as the child reported it."""
    rows: dict[str, dict[int, dict]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            match = LOG_LINE.match(line)
            if not match:
                continue
            name, n = match[1], int(match[2])
            if match[3] is not None:
                entry = {"kernel": name, "n": n, "times_s": [float(match[3])],
                         "wall_s": [float(match[4])], "extra_mib": float(match[5]),
                         "runs": int(match[6]), "log": str(path)}
            else:
                entry = {"kernel": name, "n": n, "skipped": match[7], "log": str(path)}
            entry["long"] = n in long
            previous = rows.setdefault(name, {}).get(n)
            if previous is None or "skipped" in previous:
                rows[name][n] = entry
    ordered = {name: [cells[n] for n in sorted(cells)] for name, cells in rows.items()}
    ordered = {name: ordered[name] for name in KERNELS + WINDOWED if name in ordered}
    summary = report(ordered, lengths, long)
    if json_path:
        tmp = json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"command": " ".join(sys.argv), "logs": [str(p) for p in paths],
                                   "results": ordered, "summary": summary}, indent=2) + "\n")
        os.replace(tmp, json_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS + WINDOWED)
    parser.add_argument("--long", type=int, nargs="*", default=[32768, 65536],
                        help="extra lengths run only for kernels predicted to fit (not in the fit)")
    parser.add_argument("--long-kernels", nargs="*", default=["chunked", "linear", "sparse",
                                                             "sparse-local", "sparse-bounded"],
                        choices=KERNELS)
    parser.add_argument("--max-config-s", type=float, default=30.0,
                        help="skip a configuration whose one pass is predicted (from the kernel's "
                             "measured growth) to take more CPU seconds than this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=10.0, help="stop repeating after this")
    parser.add_argument("--memory-limit-gib", type=float, default=20.0)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--stride", type=int, default=128)
    parser.add_argument("--stride-count", type=int, default=16,
                        help="sparse-bounded: strided keys at most this many strides away")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per child")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--from-logs", type=Path, nargs="+", default=None,
                        help="only rebuild the table (and --json) from the printed output of runs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.from_logs:
        merge_logs(args.from_logs, args.lengths, args.long, args.json)
        return

    limit_mib = args.memory_limit_gib * 1024
    rows: dict[str, list[dict]] = {name: [] for name in args.kernels}
    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.1f} (torch threads per child: {args.threads})",
          flush=True)
    for n in args.lengths + args.long:
        long_run = n not in args.lengths
        for name in args.kernels:
            if long_run and name not in args.long_kernels:
                continue
            measured = [r for r in rows[name] if "times_s" in r]
            guess = predicted_mib(measured, n)
            if guess is not None and guess > limit_mib:
                rows[name].append({"kernel": name, "n": n, "skipped": f"predicted {guess / 1024:.1f}"
                                   f" GiB > {args.memory_limit_gib:g} GiB"})
                print(f"{name:>14} n={n:>6}: skipped, predicted {guess / 1024:.1f} GiB", flush=True)
                continue
            if len(measured) >= 2:
                exponent = fit_exponent([r["n"] for r in measured],
                                        [statistics.median(r["times_s"]) for r in measured])
                last = measured[-1]
                eta = statistics.median(last["times_s"]) * (n / last["n"]) ** max(exponent, 1.0)
                if eta > args.max_config_s:
                    rows[name].append({"kernel": name, "n": n, "skipped": f"predicted {eta:.0f} "
                                       f"CPU s > --max-config-s {args.max_config_s:g}"})
                    print(f"{name:>14} n={n:>6}: skipped, predicted {eta:.0f} CPU s", flush=True)
                    continue
            result = run_child(name, n, args)
            result["long"] = long_run
            rows[name].append(result)
            if "error" in result:
                print(f"{name:>14} n={n:>6}: failed: {result['error']}", flush=True)
            else:
                print(f"{name:>14} n={n:>6}: cpu {statistics.median(result['times_s']):8.3f} s  "
                      f"wall {statistics.median(result['wall_s']):8.3f} s  "
                      f"extra {result['extra_mib']:9.1f} MiB  ({len(result['times_s'])} runs)",
                      flush=True)

    summary = report(rows, args.lengths, args.long)
    load_after = os.getloadavg()
    print(f"\ntotal {time.perf_counter() - started:.0f} s; load average before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f} (on {os.cpu_count()} cores)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"command": " ".join(sys.argv), "settings": {
            "batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32", "causal": True,
            "chunk_size": args.chunk_size, "window": args.window, "stride": args.stride, "stride_count": args.stride_count,
            "linear_chunk_size": 64, "time": "median process_time (CPU seconds, all threads) of "
            "the repeats; wall_s kept too", "threads": args.threads, "memory": "ru_maxrss of a fresh child minus its RSS before "
            "the first forward", "load_average_before": load_before[0],
            "load_average_after": load_after[0], "cpu_count": os.cpu_count(),
            "seconds": time.perf_counter() - started}, "results": rows, "summary": summary}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
