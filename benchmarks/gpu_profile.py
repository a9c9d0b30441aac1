"""Where a GPU LM training step's time goes: aiayn against the nanoGPT-style model, kernel by kernel.

    python3 benchmarks/gpu_profile.py                      # CUDA, GPT-2 small (gpu.py's shapes)
    python3 benchmarks/gpu_profile.py --device cpu --tiny  # checks the program runs

Sides, each a bf16-autocast training step (forward + backward + AdamW) as in ``gpu.py``'s LM row:
``aiayn`` (its own loss: the chunked projection + cross-entropy), ``aiayn-unaligned`` (the same with
the chunked loss's CPU path: unpadded rows, six elementwise passes), ``aiayn-logits`` (the same
model through the plain logits + ``F.cross_entropy`` path, to separate the loss from the layers),
``aiayn-chunk4096`` (the chunked loss at 4096 rows a chunk instead of the default 1024: fewer kernel
launches for the host-bound step) and ``nanogpt``. First checks the chunked loss's value and
gradients against the logits path's, and both against the float32 logits path
(``check_gradients``), then prints the step medians
(alternating rounds), then for each side the kernels that take the most device time in
``--profile-steps`` steps (torch.profiler), and writes it all as text.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, aiayn_optimizer, alternate, peer_optimizer  # noqa: E402
from gpu import GPT2_SMALL, TINY, synced, under_autocast  # noqa: E402
from lm_train import aiayn_loss, make_step, peer_loss  # noqa: E402
from peers import NanoGPT, aiayn_from_hf, hf_gpt2  # noqa: E402


# The plain path: the (B, T, V) logits, then F.cross_entropy in float32 (as aiayn's losses do).
logits_loss = peer_loss(lambda model, ids: model(ids).float())


def with_aligned_path(aligned: bool, step):
    """``step`` with the chunked loss's GPU path forced on or off (the A/B of that path)."""
    from aiayn.training import linear_cross_entropy as lce

    def run():
        before, lce.aligned_path = lce.aligned_path, aligned
        try:
            return step()
        finally:
            lce.aligned_path = before

    return run


def with_chunk(rows: int, step):
    """``step`` with the chunked loss projecting ``rows`` rows a chunk (the library's default is
    ``DEFAULT_CHUNK``): fewer, larger chunks launch fewer kernels, for more memory."""
    from aiayn.training import linear_cross_entropy as lce

    def run():
        plain = lce.linear_cross_entropy
        lce.linear_cross_entropy = lambda *args, **kwargs: plain(*args, **kwargs, chunk=rows)
        try:
            return step()
        finally:
            lce.linear_cross_entropy = plain

    return run


def gradients(model, loss_of, inputs, targets, device, *, autocast: bool = True):
    """(loss, {parameter name: gradient}) of one batch, under bf16 autocast or in float32."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(model, inputs, targets)
    loss.backward()
    result = loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return result


def compare(label: str, a, b) -> str:
    """Two (loss, gradients) results: each tensor's largest difference relative to its largest
    entry."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    relative = sorted((((grads_a[n] - grads_b[n]).abs().max()
                        / grads_b[n].abs().max().clamp_min(1e-30)).item(), n) for n in grads_b)
    message = (f"{label} loss: {loss_a:.6f} / {loss_b:.6f}; gradient difference relative to the "
               f"tensor's largest entry, largest three: {relative[-3:]}, median "
               f"{relative[len(relative) // 2][0]:.2e}")
    print(message, flush=True)
    return message


def check_gradients(chunked, plain, inputs, targets, device) -> list[str]:
    """The chunked loss's value and gradients against the logits path's, same weights, one batch,
    both under bf16 autocast; then each against the float32 logits path (no autocast, no TF32). Two
    bf16 paths whose products run different kernels differ at bf16 rounding even where both are
    right, so the float32 reference is what says whether the chunked path is less accurate: its
    error there should match the logits path's."""
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        reference = gradients(plain, logits_loss, inputs, targets, device, autocast=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    ours = gradients(chunked, aiayn_loss, inputs, targets, device)
    logits = gradients(plain, logits_loss, inputs, targets, device)
    return [compare("chunked vs logits (both bf16)", ours, logits),
            compare("chunked (bf16) vs float32 reference", ours, reference),
            compare("logits (bf16) vs float32 reference", logits, reference)]


def build(shapes, device):
    torch.manual_seed(0)
    ids = torch.randint(0, shapes.vocab, (shapes.batch, shapes.length + 1), device=device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    gpt2 = dict(d_model=shapes.d_model, layers=shapes.layers, heads=shapes.heads,
                vocab=shapes.vocab, positions=shapes.length)
    hf = hf_gpt2(**gpt2)
    sides = {}
    models = {}
    for name, loss in (("aiayn", aiayn_loss), ("aiayn-unaligned", aiayn_loss),
                       ("aiayn-logits", logits_loss), ("aiayn-chunk4096", aiayn_loss)):
        models[name] = model = aiayn_from_hf(hf).train().to(device)
        sides[name] = make_step(model, loss, inputs, targets, aiayn_optimizer(model))
    sides["aiayn-unaligned"] = with_aligned_path(False, sides["aiayn-unaligned"])
    sides["aiayn-chunk4096"] = with_chunk(4096, sides["aiayn-chunk4096"])
    checks = check_gradients(models["aiayn"], models["aiayn-logits"], inputs, targets, device)
    nano = NanoGPT(**gpt2).train().to(device)
    sides["nanogpt"] = make_step(nano, peer_loss(lambda m, x: m(x)), inputs, targets,
                                 peer_optimizer(nano, fused=device.type == "cuda"))
    steps = {name: synced(under_autocast(step, device), device) for name, step in sides.items()}
    return steps, checks


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "gpu_profile.txt")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    shapes = TINY if args.tiny else GPT2_SMALL
    sides, checks = build(shapes, device)
    timing = alternate(sides, rounds=args.rounds, warmup=2)
    tokens = shapes.batch * shapes.length
    lines = [f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
             f"{torch.__version__}, d{shapes.d_model} L{shapes.layers} T{shapes.length} "
             f"B{shapes.batch} V{shapes.vocab}, bf16 autocast", *checks]
    for name in sides:
        seconds = timing.median(name)
        lines.append(f"{name:<16} step {1e3 * seconds:8.2f} ms  {tokens / seconds:10.0f} tokens/s  "
                     f"nanogpt/this {timing.median('nanogpt') / seconds:.3f}")
    print("\n".join(lines), flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, step in sides.items():
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(args.profile_steps):
                step()
        table = profile.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=70)
        lines += [f"\n=== {name}: {args.profile_steps} steps, by {sort} ===", table]
        print(lines[-2], table, sep="\n", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    began = time.perf_counter()
    main(sys.argv[1:])
    print(f"{time.perf_counter() - began:.0f} s")
