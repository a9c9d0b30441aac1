"""The suite's rows on a GPU: bf16 autocast, SDPA's fused kernels, torch.compile, GPT-2-small shapes.

    python3 benchmarks/gpu.py [--compile]          # CUDA device 0; writes benchmarks/results_gpu.json
    python3 benchmarks/gpu.py --device cpu --tiny  # small shapes on the CPU: checks the program runs

The issue's GPU ask: where a GPU is lent, run the suite there (bf16, SDPA's flash path,
torch.compile) and record tokens/s and MFU at GPT-2-small shapes. Rows, each ours against its peer
in one process, alternating, medians, every call followed by a device synchronisation:

- LM training step (forward + backward + AdamW), GPT-2 small (d768, 12 layers, 12 heads, V 50257,
  T 1024, B 8), fp32 weights under bf16 autocast on every side: aiayn vs HF ``GPT2LMHeadModel`` and
  vs the nanoGPT-style model (what nanoGPT's ``train.py`` runs on a GPU: bf16 autocast, fused AdamW).
  ``--compile`` adds ``aiayn train --compile`` (each layer compiled) against HF and against the
  nanoGPT-style model compiled whole (nanoGPT's default on a GPU). Tokens/s and MFU against the bf16
  GEMM peak measured at the start of the run.
- Greedy generation, GPT-2 small with bf16 weights, batch 1 and 8, prompt 16, 256 new tokens:
  ``aiayn.decoding.sampling.generate`` vs HF ``generate``. bf16 rounding can make the two pick
  different tokens after a near tie, so the row reports the share of equal tokens instead of
  requiring all of them.
- Encoder inference, BERT-base (d768, 12 layers, T 128, B 32) with bf16 weights under
  ``torch.inference_mode``: aiayn ``TransformerEncoder`` vs HF ``BertModel``.

Peak memory of each side: ``torch.cuda.max_memory_allocated`` in a fresh subprocess that builds that
side alone (on the CPU the resident-set peak, as the CPU suite measures it). The aiayn side always
takes the peer's weights (``aiayn_from_hf``), as in the CPU suite.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (BENCH_DIR, aiayn_optimizer, alternate, mib, peak_rss_here,  # noqa: E402
                    peer_optimizer, save_results)
from lm_train import aiayn_loss, make_step, peer_loss  # noqa: E402
from peers import NanoGPT, aiayn_from_hf, hf_bert, hf_gpt2, matmul_flops_per_token  # noqa: E402

ROWS = ("lm_train", "greedy1", "greedy8", "encoder")


@dataclass(frozen=True)
class Shapes:
    d_model: int = 768
    layers: int = 12
    heads: int = 12
    vocab: int = 50257
    length: int = 1024  # LM training sequence
    batch: int = 8  # LM training batch
    prompt: int = 16
    new_tokens: int = 256
    encoder_length: int = 128
    encoder_batch: int = 32
    bert_vocab: int = 30522


GPT2_SMALL = Shapes()
TINY = Shapes(d_model=64, layers=2, heads=2, vocab=512, length=64, batch=2, new_tokens=16,
              encoder_length=32, encoder_batch=4, bert_vocab=512)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(call, device: torch.device):
    """``call`` followed by a device synchronisation, so host timers see the GPU's work."""

    def run():
        result = call()
        synchronize(device)
        return result

    return run


def gemm_peak_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """Best-of-``repeats`` throughput of an n^3 matmul in ``dtype``: the MFU denominator."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


# --- sides --------------------------------------------------------------------------------------------
def build_lm(which: list[str], shapes: Shapes, device: torch.device) -> dict:
    """LM training steps under bf16 autocast; the aiayn model takes HF GPT-2's weights."""
    from aiayn.training.distributed import compile_layers

    torch.manual_seed(0)
    ids = torch.randint(0, shapes.vocab, (shapes.batch, shapes.length + 1), device=device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    gpt2 = dict(d_model=shapes.d_model, layers=shapes.layers, heads=shapes.heads,
                vocab=shapes.vocab, positions=shapes.length)
    hf = hf_gpt2(**gpt2).train()
    sides = {}
    for name in which:
        if name in ("aiayn", "aiayn+compile"):
            model = aiayn_from_hf(hf).train().to(device)
            if name == "aiayn+compile":
                compile_layers(model)
            step = make_step(model, aiayn_loss, inputs, targets, aiayn_optimizer(model))
        elif name == "hf":
            hf = hf.to(device)
            step = make_step(hf, peer_loss(lambda m, x: m(input_ids=x).logits), inputs, targets,
                             peer_optimizer(hf, fused=True))
        elif name in ("nanogpt", "nanogpt+compile"):
            model = NanoGPT(**gpt2).train().to(device)
            optimizer = peer_optimizer(model, fused=device.type == "cuda")  # as nanoGPT chooses
            if name == "nanogpt+compile":
                model = torch.compile(model)
            step = make_step(model, peer_loss(lambda m, x: m(x)), inputs, targets, optimizer)
        else:
            raise ValueError(f"unknown LM side {name!r}")
        sides[name] = under_autocast(step, device)
    return sides


def under_autocast(step, device):
    def run():
        with _autocast(device):
            return step()

    return run


def build_greedy(which: list[str], shapes: Shapes, batch: int, device: torch.device) -> dict:
    """Greedy generation with bf16 weights; sides return the new tokens (B, new) on the CPU."""
    from aiayn.decoding.sampling import generate

    torch.manual_seed(0)
    hf = hf_gpt2(d_model=shapes.d_model, layers=shapes.layers, heads=shapes.heads,
                 vocab=shapes.vocab, positions=shapes.prompt + shapes.new_tokens).eval()
    prompt = torch.randint(1, shapes.vocab, (batch, shapes.prompt))
    sides = {}
    for name in which:
        if name == "aiayn":
            model = aiayn_from_hf(hf).eval().to(device, torch.bfloat16)
            on_device = prompt.to(device)

            def call(model=model, on_device=on_device):
                with torch.inference_mode():
                    return torch.tensor(generate(model, on_device, max_new_tokens=shapes.new_tokens,
                                                 greedy=True).tokens)
        elif name == "hf":
            hf = hf.to(device, torch.bfloat16)
            on_device = prompt.to(device)

            def call(on_device=on_device):
                return hf.generate(on_device, attention_mask=torch.ones_like(on_device),
                                   do_sample=False, num_beams=1, max_new_tokens=shapes.new_tokens,
                                   min_new_tokens=shapes.new_tokens, pad_token_id=0,
                                   eos_token_id=None)[:, shapes.prompt:].cpu()
        else:
            raise ValueError(f"unknown generation side {name!r}")
        sides[name] = call
    return sides


def build_encoder(which: list[str], shapes: Shapes, device: torch.device) -> dict:
    """Encoder forwards with bf16 weights under inference_mode; sides return the hidden states."""
    torch.manual_seed(0)
    ids = torch.randint(1, shapes.bert_vocab, (shapes.encoder_batch, shapes.encoder_length),
                        device=device)
    hf = hf_bert(d_model=shapes.d_model, layers=shapes.layers, heads=shapes.heads,
                 d_ff=4 * shapes.d_model, vocab=shapes.bert_vocab, positions=512).eval()
    sides = {}
    for name in which:
        if name == "aiayn":
            model = aiayn_from_hf(hf).eval().to(device, torch.bfloat16)

            def call(model=model):
                with torch.inference_mode():
                    return model(ids)
        elif name == "hf":
            hf = hf.to(device, torch.bfloat16)

            def call():
                with torch.inference_mode():
                    return hf(input_ids=ids).last_hidden_state
        else:
            raise ValueError(f"unknown encoder side {name!r}")
        sides[name] = call
    return sides


def build(row: str, which: list[str], shapes: Shapes, device: torch.device) -> dict:
    if row == "lm_train":
        return build_lm(which, shapes, device)
    if row in ("greedy1", "greedy8"):
        return build_greedy(which, shapes, int(row[len("greedy"):]), device)
    if row == "encoder":
        return build_encoder(which, shapes, device)
    raise ValueError(f"unknown row {row!r}; expected one of {ROWS}")


# --- peak memory, one side per subprocess ---------------------------------------------------------------
def peak_memory_here(call, device: torch.device) -> int:
    """Bytes at the peak of ``call()`` after a first call: the device allocator's peak on CUDA
    (everything this process holds there: only the one side), the resident set's on the CPU."""
    call()
    synchronize(device)
    if device.type != "cuda":
        return peak_rss_here(call)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def peak_memory_subprocess(row: str, side: str, args: argparse.Namespace) -> int | None:
    command = [sys.executable, str(Path(__file__).resolve()), "--memory", side, "--memory-row", row,
               "--device", args.device] + (["--tiny"] if args.tiny else [])
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"  [memory {row} {side} failed: {result.stderr.strip().splitlines()[-1:]}]")
        return None
    return int(result.stdout.strip().splitlines()[-1])


# --- the rows -----------------------------------------------------------------------------------------
def run_row(row: str, args: argparse.Namespace, shapes: Shapes, device: torch.device,
            peak_tflops: float) -> list[dict]:
    pairs = {"lm_train": [("aiayn", "hf"), ("aiayn", "nanogpt")]
             + ([("aiayn+compile", "hf"), ("aiayn+compile", "nanogpt+compile")] if args.compile
                else []),
             "greedy1": [("aiayn", "hf")], "greedy8": [("aiayn", "hf")],
             "encoder": [("aiayn", "hf")]}[row]
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    sides = build(row, names, shapes, device)
    first_call = {}
    outputs = {}
    for name in names:  # the first call compiles where a side compiles: timed apart
        start = time.perf_counter()
        outputs[name] = synced(sides[name], device)()
        first_call[name] = time.perf_counter() - start
    timing = alternate({name: synced(sides[name], device) for name in names},
                       rounds=args.rounds, warmup=1, budget_s=args.row_budget_s)
    if row == "lm_train":
        tokens = shapes.batch * shapes.length
        flops = matmul_flops_per_token(shapes.d_model, shapes.layers, 4 * shapes.d_model,
                                       shapes.vocab, shapes.length) * tokens
        label, metric = "lm train step (bf16 autocast)", "tokens/s"
        shape = (f"d{shapes.d_model} L{shapes.layers} T{shapes.length} B{shapes.batch} "
                 f"V{shapes.vocab}")
    elif row == "encoder":
        tokens = shapes.encoder_batch * shapes.encoder_length
        flops = matmul_flops_per_token(shapes.d_model, shapes.layers, 4 * shapes.d_model, 0,
                                       shapes.encoder_length) / 3 * tokens  # forward only
        label, metric = "encoder inference (bf16)", "tokens/s"
        shape = f"d{shapes.d_model} L{shapes.layers} T{shapes.encoder_length} B{shapes.encoder_batch}"
    else:
        batch = int(row[len("greedy"):])
        tokens, flops = batch * shapes.new_tokens, None
        label, metric = f"greedy generation (bf16), batch {batch}", "new tokens/s"
        shape = f"d{shapes.d_model} L{shapes.layers} +{shapes.new_tokens}"
    memory = {name: peak_memory_subprocess(row, name, args) for name in names} if args.memory \
        else {}
    rows = []
    for ours, peer in pairs:
        seconds_ours, seconds_peer = timing.median(ours), timing.median(peer)
        entry = dict(benchmark=label, shape=shape, ours=ours, peer=peer, metric=metric,
                     ours_value=tokens / seconds_ours, peer_value=tokens / seconds_peer,
                     ratio=seconds_peer / seconds_ours,
                     ours_memory=memory.get(ours), peer_memory=memory.get(peer),
                     ours_first_call_s=first_call[ours], peer_first_call_s=first_call[peer])
        if row == "lm_train":  # the same weights and batch: the same first loss up to bf16 rounding
            entry.update(ours_first_loss=outputs[ours].item(), peer_first_loss=outputs[peer].item())
        if flops is not None:
            entry.update(ours_tflops=flops / seconds_ours / 1e12,
                         peer_tflops=flops / seconds_peer / 1e12,
                         ours_mfu=flops / seconds_ours / 1e12 / peak_tflops,
                         peer_mfu=flops / seconds_peer / 1e12 / peak_tflops)
        if row.startswith("greedy"):
            same = (outputs[ours] == outputs[peer]).float().mean().item()
            entry["same_tokens"] = same
        if row == "encoder":
            entry["max_abs_difference"] = (outputs[ours].float()
                                           - outputs[peer].float()).abs().max().item()
        rows.append(entry)
    return rows


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def print_row(row: dict) -> None:
    mfu = (f"  MFU {100 * row['ours_mfu']:.0f}% / {100 * row['peer_mfu']:.0f}%"
           if "ours_mfu" in row else "")
    extra = (f"  same tokens {100 * row['same_tokens']:.0f}%" if "same_tokens" in row else "")
    print(f"{row['benchmark']:<40} {row['ours']:<14} vs {row['peer']:<16} "
          f"{row['ours_value']:10.0f} / {row['peer_value']:10.0f} {row['metric']}  "
          f"ratio {row['ratio']:.2f}{mfu}  memory MiB {mib(row['ours_memory'])} / "
          f"{mib(row['peer_memory'])}{extra}", flush=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a check that it runs)")
    parser.add_argument("--only", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--compile", action="store_true", help="add the compiled LM rows")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--row-budget-s", type=float, default=None,
                        help="stop a row's timing rounds (after 3) once this many seconds are spent")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak-memory subprocesses")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results_gpu.json")
    parser.add_argument("--memory", dest="memory_side", metavar="SIDE", help=argparse.SUPPRESS)
    parser.add_argument("--memory-row", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu (with --tiny) to check the program")
    shapes = TINY if args.tiny else GPT2_SMALL
    if args.memory_side:
        sides = build(args.memory_row, [args.memory_side], shapes, device)
        print(peak_memory_here(sides[args.memory_side], device))
        return
    began = time.perf_counter()
    peak = gemm_peak_tflops(device, torch.bfloat16, 512 if args.tiny else 8192)
    peak_fp32 = gemm_peak_tflops(device, torch.float32, 512 if args.tiny else 8192)
    print(f"{describe(device)}: bf16 GEMM peak {peak:.1f} TFLOP/s, fp32 {peak_fp32:.1f} "
          f"(n^3 matmuls, best of 10); torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    failed: dict[str, str] = {}  # row -> traceback

    def save(finished: bool) -> None:  # after every row: a run cut short keeps what it measured
        save_results(args.out, dict(
            command="python3 benchmarks/gpu.py " + " ".join(argv), device=describe(device),
            torch=torch.__version__, bf16_gemm_peak_tflops=peak, fp32_gemm_peak_tflops=peak_fp32,
            shapes=asdict(shapes), seconds=time.perf_counter() - began, finished=finished,
            rows=rows, failed_rows=failed))

    for row in args.only:
        try:
            entries = run_row(row, args, shapes, device, peak)
        except Exception:  # one broken row must not cost the others a (rarely lent) GPU's run
            failed[row] = traceback.format_exc()
            print(f"row {row} failed:\n{failed[row]}", flush=True)
            continue
        for entry in entries:
            rows.append(entry)
            print_row(entry)
        save(finished=False)
    save(finished=True)
    print(f"{time.perf_counter() - began:.0f} s; wrote {args.out}")
    if failed:
        sys.exit(f"rows that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main(sys.argv[1:])
