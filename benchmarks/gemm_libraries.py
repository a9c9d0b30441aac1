"""The fp32 GEMMs PyTorch ships (MKL on x86) against OpenBLAS (numpy's), at the suite's shapes.

Why: the encoder-inference and training rows spend 75-90 % of their time in these products, so
their ratios against the peers (which run the same PyTorch products) are bounded by them. This
program asks whether another BLAS on the same machine would lift that bound.

Two measurements:

- each library alone, in its own subprocess (``--library mkl|openblas``), so only its own thread
  pool runs: GFLOP/s of ``bias + x @ W.T`` at the encoder row's and the LM row's products, and the
  square 1024^3 / 2048^3 products the suite's GEMM peak uses. MKL is ``torch.addmm`` into a
  preallocated output; OpenBLAS is ``numpy.matmul`` into its output, then the bias added in place
  by numpy (MKL's ``addmm`` also writes the bias into the output before its product).
- ``--forward``: the encoder row's aiayn forward (``encoder_inference.py``, full rows) with its
  products of more than SMALL_ROWS rows through OpenBLAS, alternating in one process with the plain
  forward (MKL) and HF BERT. Here both libraries' thread pools live in one process: OpenBLAS's
  threads and PyTorch's OpenMP threads each spin for a while after their own work, so on 2 cores
  they take turns stealing each other's cores. Rerun it with ``GOMP_SPINCOUNT=0
  OPENBLAS_THREAD_TIMEOUT=4`` (read when the libraries load, not settable from inside) to see the
  forward without that contention.

    python3 benchmarks/gemm_libraries.py [--rounds 7]
    python3 benchmarks/gemm_libraries.py --forward [--rounds 8]

Legend: M rows, K input width, N output width (the product is (M, K) x (K, N)).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from common import BENCH_DIR, THREADS, alternate, setup

# (M, K, N, what): the encoder row (all-MiniLM shapes, 32 x 128 tokens), the LM row (d 256, 8 x 256
# tokens), the loss's vocabulary block, and the square products of the GEMM peak
SHAPES = [
    (4096, 384, 1152, "encoder QKV"), (4096, 384, 384, "encoder attention out"),
    (4096, 384, 1536, "encoder FFN in"), (4096, 1536, 384, "encoder FFN out"),
    (2048, 256, 768, "LM QKV"), (2048, 256, 256, "LM attention out"),
    (2048, 256, 1024, "LM FFN in"), (2048, 1024, 256, "LM FFN out"),
    (1024, 256, 8192, "LM loss block"),
    (1024, 1024, 1024, "square 1024"), (2048, 2048, 2048, "square 2048"),
]


def product(library: str, m: int, k: int, n: int):
    """A callable computing bias + x @ W.T (M, N) into a preallocated output with ``library``."""
    x, weight, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out = torch.empty(m, n)
    if library == "mkl":
        return lambda: torch.addmm(bias, x, weight.t(), out=out)
    x_np, weight_t_np, out_np, bias_np = x.numpy(), weight.numpy().T, out.numpy(), bias.numpy()

    def openblas():  # numpy's add too: a PyTorch operator here would wake its OpenMP threads
        np.matmul(x_np, weight_t_np, out=out_np)
        return np.add(out_np, bias_np, out=out_np)

    return openblas


def library_main(library: str, rounds: int) -> None:
    """Body of ``--library``: one line per shape, 'M K N GFLOP/s' (median of ``rounds``)."""
    setup()
    for m, k, n, _ in SHAPES:
        call = product(library, m, k, n)
        repeats = max(3, int(1e9 / (2 * m * k * n)))  # ~1 GFLOP a round
        for _ in range(3):
            call()
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            seconds.append((time.perf_counter() - start) / repeats)
        print(m, k, n, 2 * m * k * n / statistics.median(seconds) / 1e9, flush=True)


def measure_library(library: str, rounds: int) -> dict[tuple[int, int, int], float]:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(THREADS))
    result = subprocess.run([sys.executable, str(BENCH_DIR / "gemm_libraries.py"), "--library",
                             library, "--rounds", str(rounds)],
                            capture_output=True, text=True, env=env, check=True)
    rates = {}
    for line in result.stdout.split("\n"):
        if line.strip():
            m, k, n, rate = line.split()
            rates[int(m), int(k), int(n)] = float(rate)
    return rates


def compare_libraries(rounds: int) -> None:
    """Each library in its own process, alternating mkl, openblas, openblas, mkl."""
    runs = {"mkl": [], "openblas": []}
    for order in (("mkl", "openblas"), ("openblas", "mkl")):
        for library in order:
            runs[library].append(measure_library(library, rounds))
    print(f"{THREADS} threads, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}), numpy {np.__version__}; GFLOP/s, "
          "median of the two runs' medians")
    print(f"{'product':<22} {'M K N':>16} {'MKL':>7} {'OpenBLAS':>9} {'OpenBLAS/MKL':>13}")
    for m, k, n, what in SHAPES:
        mkl = statistics.median(run[m, k, n] for run in runs["mkl"])
        openblas = statistics.median(run[m, k, n] for run in runs["openblas"])
        print(f"{what:<22} {f'{m} {k} {n}':>16} {mkl:7.1f} {openblas:9.1f} {openblas / mkl:13.3f}")


@contextlib.contextmanager
def openblas_products():
    """Inside, ``nn.Linear`` multiplies more than SMALL_ROWS rows through numpy's OpenBLAS (no
    autograd, CPU float32, contiguous input); the aiayn encoder's large products go through
    ``nn.Linear`` where oneDNN's are off (PyTorch's AVX2 kernels)."""
    from aiayn.inference_linear import SMALL_ROWS

    plain = torch.nn.Linear.forward

    def forward(layer, x):
        rows = x.numel() // x.shape[-1]
        if (torch.is_grad_enabled() or rows <= SMALL_ROWS or not x.is_contiguous()
                or x.dtype != torch.float32 or x.device.type != "cpu"):
            return plain(layer, x)
        weight = layer.weight
        out = torch.empty(*x.shape[:-1], weight.shape[0])
        np.matmul(x.reshape(rows, -1).numpy(), weight.detach().numpy().T,
                  out=out.view(rows, -1).numpy())
        return out if layer.bias is None else out.add_(layer.bias)

    torch.nn.Linear.forward = forward
    try:
        yield
    finally:
        torch.nn.Linear.forward = plain


def compare_forward(rounds: int) -> None:
    import encoder_inference

    setup()
    sides = encoder_inference.build_sides(["aiayn", "hf"])
    ours = sides["aiayn"]

    def ours_openblas():
        with openblas_products():
            return ours()

    reference, through_openblas = ours(), ours_openblas()
    difference = (reference - through_openblas).abs().max().item()
    assert difference < 1e-3, f"the OpenBLAS forward differs by {difference}"
    timing = alternate({"aiayn (MKL)": ours, "aiayn (OpenBLAS)": ours_openblas, "hf": sides["hf"]},
                       rounds=rounds, warmup=2)
    spin = {name: os.environ.get(name, "unset") for name in ("GOMP_SPINCOUNT",
                                                              "OPENBLAS_THREAD_TIMEOUT")}
    print(f"encoder forward, full rows, {THREADS} threads, {spin}; ms, median of {rounds} rounds")
    for name in timing.seconds:
        print(f"  {name:<18} {timing.median(name) * 1e3:8.1f}  HF/this "
              f"{timing.median('hf') / timing.median(name):.3f}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--forward", action="store_true", help="the encoder forward through each")
    parser.add_argument("--library", choices=("mkl", "openblas"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.library:
        library_main(args.library, args.rounds or 7)
    elif args.forward:
        compare_forward(args.rounds or 8)
    else:
        compare_libraries(args.rounds or 7)


if __name__ == "__main__":
    main(sys.argv[1:])
