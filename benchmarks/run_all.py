"""Run every side-by-side benchmark; print one table; write benchmarks/results.json.

    python3 benchmarks/run_all.py            # the whole suite (about 6 minutes on an idle 2-core CPU)
    python3 benchmarks/run_all.py --quick    # fewer rounds, no peak-memory subprocesses
    python3 benchmarks/run_all.py --quick --rounds 1 --only encoder_inference  # a quick check
    python3 benchmarks/run_all.py --only lm_train generation --compile --d-model 256 512
    python3 benchmarks/run_all.py --compile --one-process

Each row: the median throughput of aiayn and of the peer, measured alternately in one process, their
ratio (ours/peer, > 1 means aiayn is faster), GFLOP/s and MFU against the fp32 GEMM peak measured at the
start of the same run, and the peak resident memory of each side measured in its own subprocess.

Each benchmark script runs in a fresh interpreter, as running the script alone (or a user's training
or serving process) does; its two sides share that interpreter. ``--one-process`` runs every
benchmark in this process, one after another, as the suite did until 2026-11-26: a benchmark then
inherits the heap the earlier ones left, the peers' steps take fewer page faults late in a process
than in a fresh one, and by how much depends on what ran before (docs/performance.md, the suite
after the seventeenth pass), so a row's figure depends on the rows before it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (BENCH_DIR, THREADS, cpu_name, gemm_peak_gflops, mib, save_results,  # noqa: E402
                    setup)

SUITES = ("lm_train", "seq2seq_train", "generation", "encoder_inference")


def table(rows: list[dict], peak: float) -> str:
    header = (f"{'benchmark':<32} {'ours':<16} {'peer':<10} {'ours':>9} {'peer':>9} {'ratio':>6} "
              f"{'MFU ours':>8} {'MFU peer':>8} {'RSS MiB ours/peer':>18}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = row["ours_value"] / row["peer_value"]
        mfu = (f"{100 * row['ours_gflops'] / peak:7.0f}% {100 * row['peer_gflops'] / peak:7.0f}%"
               if row.get("ours_gflops") else f"{'':>8} {'':>8}")
        rss = f"{mib(row.get('ours_rss'))}/{mib(row.get('peer_rss'))}"
        lines.append(f"{row['benchmark']:<32} {row['ours']:<16} {row['peer']:<10} "
                     f"{row['ours_value']:9.0f} {row['peer_value']:9.0f} {ratio:6.2f} {mfu} {rss:>18}")
        if row.get("compile_s"):
            lines.append(f"{'':<32} (torch.compile time {row['compile_s']:.0f} s)")
    return "\n".join(lines)


def suite_rows(name: str, args: argparse.Namespace) -> list[dict]:
    """The rows of one benchmark script, run in this process."""
    memory = not args.quick

    def rounds(full: int) -> int:  # --rounds, else the suite's own (3 with --quick)
        return args.rounds or (3 if args.quick else full)

    if name == "lm_train":
        import lm_train

        rows = []
        for d_model in args.d_model:
            rows += lm_train.run(d_model, compile_ours=args.compile, rounds=rounds(5),
                                 memory=memory)
        return rows
    if name == "seq2seq_train":
        import seq2seq_train

        return seq2seq_train.run(rounds=rounds(4), memory=memory)
    if name == "generation":
        import generation

        return generation.run(rounds=rounds(4), memory=memory)
    import encoder_inference

    return encoder_inference.run(rounds=rounds(4), memory=memory)


def suite_rows_in_fresh_process(name: str, args: argparse.Namespace) -> list[dict]:
    """The rows of one benchmark script, run by a fresh interpreter (``--rows-out``)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--only", name,
               "--d-model", *map(str, args.d_model)]
    command += ["--quick"] * args.quick + ["--compile"] * args.compile
    command += ["--rounds", str(args.rounds)] if args.rounds else []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        subprocess.run(command + ["--rows-out", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text(encoding="utf-8"))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="aiayn vs peers, side by side")
    parser.add_argument("--only", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("--quick", action="store_true", help="fewer rounds, no memory subprocesses")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile'd aiayn (LM)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timing rounds of every benchmark (default: each one's own, 3 with "
                             "--quick; fewer: a check that the suite runs)")
    parser.add_argument("--d-model", type=int, nargs="+", default=[256], help="LM widths")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results.json")
    parser.add_argument("--one-process", dest="process_per_benchmark", action="store_false",
                        help="run every benchmark in this process (by default each benchmark script "
                             "runs in a fresh interpreter)")
    parser.add_argument("--process-per-benchmark", action="store_true",
                        help=argparse.SUPPRESS)  # the default; kept so recorded commands still run
    parser.set_defaults(process_per_benchmark=True)
    parser.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)  # a fresh process's rows
    args = parser.parse_args(argv)
    setup()
    if args.rows_out:
        rows = [row for name in args.only for row in suite_rows(name, args)]
        args.rows_out.write_text(json.dumps(rows), encoding="utf-8")
        return
    began = time.perf_counter()
    load_before = os.getloadavg()
    peak = gemm_peak_gflops()
    print(f"fp32 GEMM peak (1024^3 matmul, best of 15): {peak:.1f} GFLOP/s; threads {THREADS}; "
          f"load average {load_before[0]:.2f}", flush=True)
    rows: list[dict] = []

    def record(finished: bool) -> None:  # after every suite, so an interrupted run keeps its rows
        for row in rows:
            row["ratio"] = row["ours_value"] / row["peer_value"]
        save_results(args.out, dict(
            command="python3 benchmarks/run_all.py " + " ".join(argv), machine=cpu_name(),
            process_per_benchmark=args.process_per_benchmark,
            cores=os.cpu_count(), threads=THREADS, torch=torch.__version__, gemm_peak_gflops=peak,
            seconds=time.perf_counter() - began, load_average_before=load_before[0],
            load_average_now=os.getloadavg()[0], finished=finished, rows=rows))

    run_suite = suite_rows_in_fresh_process if args.process_per_benchmark else suite_rows
    for name in [name for name in SUITES if name in args.only]:
        rows += run_suite(name, args)
        print(table(rows, peak), flush=True)
        record(False)
    elapsed = time.perf_counter() - began
    print()
    print(table(rows, peak))
    load_after = os.getloadavg()
    print(f"\n{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {THREADS} threads; "
          f"{elapsed:.0f} s; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    record(True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
