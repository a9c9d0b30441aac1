"""Shared machinery of the side-by-side benchmarks: alternating timing, GEMM peak, peak RSS.

Every benchmark builds aiayn and a peer on identical architectures and inputs (the aiayn model takes the
peer's weights), then times them *in the same process, alternating* (ours, peer, peer, ours, ...) after a
warm-up, and reports medians and the ratio ours/peer. Alternation matters on a shared machine: a burst of
load from another process hits both sides instead of one.

Peak memory is measured separately, one side per subprocess (``python3 benchmarks/NAME.py --memory SIDE``):
the process builds its side, resets the kernel's high-water mark (``/proc/self/clear_refs``), runs the
workload and reads ``VmHWM``, so the figure is the resident peak while working, not while building.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

BENCH_DIR = Path(__file__).resolve().parent
THREADS = int(os.environ.get("AIAYN_BENCH_THREADS", "2"))


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family and model: "AMD EPYC" alone has covered
    machines whose ratios differ (Zen 1 and Zen 3, docs/performance.md)."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():  # the first processor is enough
                break
    except OSError:
        return platform.processor() or "unknown"
    name = fields.get("model name", platform.processor() or "unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def setup() -> None:
    """Same thread settings for every side (they share the process)."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)


def cpu_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's bf16 kernels natively (AVX512_BF16 / AMX): the suite's bf16
    autocast rows are measured only there (elsewhere bf16 is emulated and says nothing)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def under_bf16_autocast(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` run under CPU bf16 autocast (every side of a bf16 row, the peer's too)."""

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return call()

    return run


def gemm_peak_gflops(n: int = 1024, repeats: int = 15) -> float:
    """Measured fp32 matmul throughput (GFLOP/s) of this machine: the MFU denominator."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / min(times) / 1e9  # best of: the peak, not the typical


@dataclass
class Timing:
    """Per-side lists of seconds per call, one entry per round."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def median(self, side: str) -> float:
        return statistics.median(self.seconds[side])


def alternate(sides: dict[str, Callable[[], object]], *, rounds: int, warmup: int = 2,
              calls: int = 1, budget_s: float | None = None) -> Timing:
    """Time each side's callable ``rounds`` times, alternating the order every round.

    Each round calls a side ``calls`` times and records the mean; ``warmup`` untimed calls per side
    come first. ``budget_s`` stops early (after at least 3 rounds) when the wall clock runs out.
    """
    names = list(sides)
    for name in names:
        for _ in range(warmup):
            sides[name]()
    timing = Timing({name: [] for name in names})
    began = time.perf_counter()
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            gc.collect()
            start = time.perf_counter()
            for _ in range(calls):
                sides[name]()
            timing.seconds[name].append((time.perf_counter() - start) / calls)
        if budget_s is not None and round_index >= 2 and time.perf_counter() - began > budget_s:
            break
    return timing


def peak_rss_here(work: Callable[[], object]) -> int:
    """Resident-set high-water mark (bytes) of this process while running ``work``.

    Freed heap memory is handed back to the OS first (glibc ``malloc_trim``): the aiayn side builds
    the peer's model to copy its weights, and without the trim the freed peer would still count in
    aiayn's resident set.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the figure may include freed heap pages
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass  # not Linux / not permitted: the peak then includes the build phase
    work()
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_rss_subprocess(script: str, side: str, extra: list[str] | None = None) -> int | None:
    """Run ``script --memory side`` in a fresh interpreter; its last stdout line is the peak bytes."""
    command = [sys.executable, str(BENCH_DIR / script), "--memory", side, *(extra or [])]
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if result.returncode != 0:
        print(f"  [memory {script} {side} failed: {result.stderr.strip().splitlines()[-1:]}]")
        return None
    return int(result.stdout.strip().splitlines()[-1])


def memory_main(build: Callable[[str], Callable[[], object]], side: str, steps: int) -> None:
    """Body of ``--memory SIDE``: build one side, run ``steps`` calls, print the peak RSS."""
    setup()
    step = build(side)
    step()  # first call allocates lazily-created state (optimizer moments, caches)

    def work():
        for _ in range(steps):
            step()

    print(peak_rss_here(work))


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2 ** 20:.0f}"


def save_results(path: Path, results: dict) -> None:
    """Atomic JSON write (temp file in the same directory, fsync, rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def encoder_inference_main(script: str, description: str, run: Callable[..., list[dict]],
                           layers: int, argv: list[str], **shape: int) -> None:
    """The command line of an encoder-inference comparison (``--rounds``, ``--layers``, ``--out``,
    and ``--NAME`` for each integer in ``shape`` with its default): ``run(rounds=, layers=,
    **shape)`` -> rows, printed and, with ``--out``, saved with the command, the CPU and the
    versions."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--layers", type=int, default=layers)
    for name, default in shape.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run(rounds=args.rounds, layers=args.layers,
               **{name: getattr(args, name) for name in shape})
    for row in rows:
        print(f"{row['benchmark']:<42} {row['ours_value']:8.0f} vs {row['peer_value']:8.0f} "
              f"tokens/s  ratio {row['ratio']:.3f}  (max |diff| {row['max_abs_difference']:.1e})")
    if args.out is not None:
        import transformers

        command = f"python3 benchmarks/{script} " + " ".join(argv)
        save_results(args.out, dict(command=command.strip(), cpu=cpu_name(),
                                    torch=torch.__version__,
                                    transformers=transformers.__version__, rows=rows))


# --- the optimizer each side's own training code builds ------------------------------------------
# Same hyper-parameters on every side (AdamW, lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay
# 0.1 on matrices only); the implementation is the one each library's training code picks on CPU:
#   aiayn:   aiayn.training.make_optimizer (torch's fused AdamW where it applies);
#   HF:      Trainer's default ``optim="adamw_torch_fused"`` (TrainingArguments, transformers 5.23),
#            i.e. ``AdamW(fused=True)``, no decay on biases and LayerNorm weights (the 1-D tensors);
#   nanoGPT: ``configure_optimizers`` passes fused=True only on CUDA: the default (foreach) on CPU;
#   torch.nn: what a torch user writes, ``torch.optim.AdamW(...)`` (the default, foreach).
LEARNING_RATE, WEIGHT_DECAY = 1e-4, 0.1


def aiayn_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer aiayn's trainer builds (``make_optimizer``) for the benchmark settings."""
    from aiayn.training import Schedule, TrainingConfig, make_optimizer

    config = TrainingConfig(optimizer="adamw", betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WEIGHT_DECAY, decay_matrices_only=True,
                            schedule=Schedule(kind="constant", peak=LEARNING_RATE, warmup=0))
    return make_optimizer(model, config)


def peer_optimizer(model: torch.nn.Module, *, fused: bool) -> torch.optim.Optimizer:
    """AdamW with the same settings; ``fused``: torch's fused kernel (HF Trainer's default)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
                             fused=True if fused else None)
