"""Microbenchmark: the products of a decoding step (few rows), by weight layout.

Default: the output projection (few rows onto a large vocabulary). Times, alternately and with
medians, the layouts ``aiayn.inference_linear.small_rows_linear`` chooses between: ``F.linear`` on the
(O, I) weight, the vocabulary-major product (W @ h^T)^T, a transposed (I, O) copy, MKL's packed matrix,
oneDNN's packed weight and (one row, 2+ threads) ``split_gemv``; and checks each against ``F.linear``.

``--decoder-step``: the layers' products of one decoding step instead (per layer the (3D, D) QKV,
(D, D) output, with ``--cross`` the cross-attention's (D, D) query and output, (F, D) and (D, F) FFN
matrices; every matrix distinct, so they come from memory as in a real step): ``linear``, oneDNN
unpacked, oneDNN packed (what ``inference_linear.linear`` does at 2..64 rows) and ``split_gemv``.

    python3 benchmarks/small_rows_linear.py                       # 256 -> 8192, rows 1 8 16
    AIAYN_BENCH_THREADS=1 python3 benchmarks/small_rows_linear.py --shape 512x32000 --rows 1 4
    python3 benchmarks/small_rows_linear.py --decoder-step --layers 3 --cross --rows 1 4 8 16

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

from aiayn import inference_linear


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
    if rows == 1 and torch.get_num_threads() > 1:
        sides["split"] = lambda: inference_linear.split_gemv(x, weight, bias,
                                                             torch.get_num_threads())
    return sides


def step_shapes(d_model: int, layers: int, d_ff: int, cross: bool) -> list[tuple[int, int]]:
    """(O, I) of every product a decoder step makes in its layers."""
    per_layer = [(3 * d_model, d_model), (d_model, d_model)]
    if cross:
        per_layer += [(d_model, d_model), (d_model, d_model)]
    return (per_layer + [(d_ff, d_model), (d_model, d_ff)]) * layers


def step_variants(weights: list, biases: list, rows: int) -> dict:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    pointwise = torch.ops.mkldnn._linear_pointwise

    def run(product):
        def call():
            return [product(inputs[w.shape[1]], w, b, i) for i, (w, b) in enumerate(zip(weights, biases))]
        return call

    sides = {"linear": run(lambda x, w, b, i: F.linear(x, w, b))}
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        sides["onednn"] = run(lambda x, w, b, i: pointwise(x, w, b, "none", [], ""))
        sides["onednn-packed"] = run(lambda x, w, b, i: pointwise(x, packed[i], b, "none", [], ""))
    threads = torch.get_num_threads()
    if rows == 1 and threads > 1 and all(w.shape[0] % threads == 0 for w in weights):
        sides["split"] = run(lambda x, w, b, i: inference_linear.split_gemv(x, w, b, threads))
    return sides


def decoder_step_main(args) -> None:
    shapes = step_shapes(args.d_model, args.layers, 4 * args.d_model, args.cross)
    torch.manual_seed(0)
    weights = [torch.randn(o, i) / i ** 0.5 for o, i in shapes]
    biases = [torch.randn(o) for o, _ in shapes]
    with torch.inference_mode():
        for rows in args.rows:
            sides = step_variants(weights, biases, rows)
            reference = sides["linear"]()
            for name, call in sides.items():
                error = max((a - r).abs().max().item() for a, r in zip(call(), reference))
                assert error < 1e-3, f"{name} differs from linear by {error}"
            names = list(sides)
            results = {name: [] for name in names}
            for index in range(3):
                for name in names if index % 2 == 0 else names[::-1]:
                    results[name].append(_median_us(sides[name], number=5))
            print(f"d{args.d_model} {args.layers} layers{' +cross' if args.cross else ''}, "
                  f"{len(shapes)} products, rows {rows:3d}: " + "  ".join(
                      f"{name} {statistics.median(values):8.1f} us"
                      for name, values in results.items()), flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="256x8192", help="IxO")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--decoder-step", action="store_true",
                        help="the layers' products of a decoding step instead of the projection")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--cross", action="store_true", help="encoder-decoder (cross-attention)")
    args = parser.parse_args(argv)
    setup()
    if args.decoder_step:
        decoder_step_main(args)
        return
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
