"""Microbenchmark: the output projection of a decoding step (few rows onto a large vocabulary).

Times, alternately and with medians, the layouts ``aiayn.inference_linear.small_rows_linear`` chooses
between: ``F.linear`` on the (O, I) weight, the vocabulary-major product (W @ h^T)^T, a transposed
(I, O) copy, MKL's packed matrix and oneDNN's packed weight; and checks each against ``F.linear``.

    python3 benchmarks/small_rows_linear.py                       # 256 -> 8192, rows 1 8 16
    AIAYN_BENCH_THREADS=1 python3 benchmarks/small_rows_linear.py --shape 512x32000 --rows 1 4

Legend: N rows, I input width, O output width.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from common import setup


def _median_us(call, repeats: int = 7, number: int = 30) -> float:
    for _ in range(5):
        call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples) * 1e6


def variants(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> dict:
    rows = x.shape[0]
    transposed = weight.t().contiguous()  # (I, O)
    sides = {"linear": lambda: F.linear(x, weight, bias),
             "vocabulary-major": lambda: torch.addmm(bias.unsqueeze(1), weight, x.t()).t().contiguous(),
             "transposed": lambda: torch.addmm(bias, x, transposed)}
    mkl = getattr(torch.ops, "mkl", None)
    if mkl is not None and hasattr(mkl, "_mkl_linear"):
        packed = mkl._mkl_reorder_linear_weight(weight, rows)
        sides["mkl-packed"] = lambda: mkl._mkl_linear(x, packed, weight, bias, rows)
    if torch.backends.mkldnn.is_available():
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        sides["onednn-packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, onednn, bias, "none", [], "")
    return sides


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="256x8192", help="IxO")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    args = parser.parse_args(argv)
    setup()
    inputs, outputs = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    weight, bias = torch.randn(outputs, inputs), torch.randn(outputs)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, inputs)
            sides = variants(weight, bias, x)
            reference = F.linear(x, weight, bias)
            for name, call in sides.items():
                error = (call() - reference).abs().max().item()
                assert error < 1e-3, f"{name} differs from linear by {error}"
            # alternate: every side once per pass, the order reversed every other pass
            names = list(sides)
            results = {name: [] for name in names}
            for index in range(3):
                for name in names if index % 2 == 0 else names[::-1]:
                    results[name].append(_median_us(sides[name]))
            print(f"{args.shape} rows {rows:3d}: " + "  ".join(
                f"{name} {statistics.median(values):8.1f} us" for name, values in results.items()),
                flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
