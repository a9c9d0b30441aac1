"""Training step (forward + backward + AdamW) of a decoder-only LM: aiayn vs HF GPT-2 vs nanoGPT-style.

aiayn's ``CausalLM`` is built from the HF ``GPT2LMHeadModel``'s weights (same architecture by
construction); the nanoGPT-style model is the same architecture written minimally on SDPA. All sides
compute the same loss (mean next-token cross-entropy) with the same AdamW settings in one process;
each side uses its own library's loss path and AdamW implementation (see ``common.aiayn_optimizer``):
aiayn its trainer's ``make_optimizer`` (fused AdamW) and ``token_loss`` (chunked projection + loss),
HF the Trainer's default fused AdamW, nanoGPT the default (foreach) AdamW it uses on CPU.

On CPUs with native bf16 kernels the step of aiayn and of HF GPT-2 is timed again under CPU bf16
autocast (each side its own model; the "lm train step (bf16)" row).

``--compile`` adds ``aiayn+compile``, what ``aiayn train --compile`` does in one process
(``torch.compile`` of the task's loss: the model and its loss in one graph).

    python3 benchmarks/lm_train.py [--d-model 256] [--compile]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from common import (aiayn_optimizer, alternate, cpu_bf16_supported, memory_main, mib,
                    peak_rss_subprocess, peer_optimizer, setup, under_bf16_autocast)
from peers import NanoGPT, aiayn_from_hf, hf_gpt2, matmul_flops_per_token

from aiayn.tasks.lm import token_loss

LAYERS, LENGTH, BATCH, VOCAB = 4, 256, 8, 8192


def shapes(d_model: int) -> dict:
    return dict(d_model=d_model, layers=LAYERS, heads=d_model // 64, vocab=VOCAB, positions=LENGTH)


def make_step(model, loss_of, ids, targets, optimizer):
    """One training step: ``loss_of(model, ids, targets)`` is the mean loss over the targets."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, ids, targets)
        loss.backward()
        optimizer.step()
        return loss

    return step


def peer_loss(logits_of):
    def loss_of(model, ids, targets):
        logits = logits_of(model, ids)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    return loss_of


def aiayn_loss(model, ids, targets):
    """aiayn's own LM training loss (``aiayn.tasks.lm.token_loss``: on a CPU the chunked projection +
    loss), as a mean like the peers'."""
    return token_loss(model, ids, targets) / targets.numel()


def build_sides(d_model: int, which: list[str], compile_ours: bool = False) -> dict:
    """side name -> step callable; the aiayn model takes the HF model's weights."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    hf = hf_gpt2(**shapes(d_model)).train()
    sides = {}
    for name in which:
        if name in ("aiayn-bf16", "hf-bf16"):  # the same step, its own model, bf16 autocast
            base = name.removesuffix("-bf16")
            sides[name] = under_bf16_autocast(build_sides(d_model, [base])[base])
        elif name.startswith("aiayn"):
            model = aiayn_from_hf(hf).train()
            optimizer = aiayn_optimizer(model)
            loss = torch.compile(aiayn_loss) if name == "aiayn+compile" else aiayn_loss
            sides[name] = make_step(model, loss, inputs, targets, optimizer)
        elif name == "hf":
            sides[name] = make_step(hf, peer_loss(lambda m, x: m(input_ids=x).logits), inputs,
                                    targets, peer_optimizer(hf, fused=True))
        elif name == "nanogpt":
            model = NanoGPT(**shapes(d_model)).train()
            sides[name] = make_step(model, peer_loss(lambda m, x: m(x)), inputs, targets,
                                    peer_optimizer(model, fused=False))
    return sides


def run(d_model: int = 256, *, compile_ours: bool = False, rounds: int = 8,
        memory: bool = True) -> list[dict]:
    setup()
    names = ["aiayn", "hf", "nanogpt"]
    bf16 = ["aiayn-bf16", "hf-bf16"] if cpu_bf16_supported() else []
    sides = build_sides(d_model, names + bf16)
    compiled = ["aiayn+compile"] if compile_ours else []
    compile_s = {}
    for name in compiled:
        sides.update(build_sides(d_model, [name]))
        start = time.perf_counter()
        sides[name]()  # first call compiles forward and backward
        sides[name]()
        compile_s[name] = time.perf_counter() - start
    timing = alternate(sides, rounds=rounds, warmup=2)
    tokens = BATCH * LENGTH
    flops = matmul_flops_per_token(d_model, LAYERS, 4 * d_model, VOCAB, LENGTH) * tokens
    result = {name: {"tokens_per_s": tokens / timing.median(name),
                     "gflops": flops / timing.median(name) / 1e9,
                     "seconds": timing.seconds[name]} for name in sides}
    for name, seconds in compile_s.items():
        result[name]["compile_s"] = seconds
    if memory:
        for name in names + bf16:
            result[name]["peak_rss"] = peak_rss_subprocess("lm_train.py", name,
                                                           ["--d-model", str(d_model)])
    rows = []
    shape = f"d{d_model} L{LAYERS} T{LENGTH} B{BATCH} V{VOCAB}"
    ours_names = ["aiayn"] + compiled
    for ours in ours_names:
        for peer in ("hf", "nanogpt"):
            rows.append(dict(benchmark="lm train step", shape=shape, ours=ours, peer=peer,
                             metric="tokens/s", ours_value=result[ours]["tokens_per_s"],
                             peer_value=result[peer]["tokens_per_s"],
                             ours_gflops=result[ours]["gflops"], peer_gflops=result[peer]["gflops"],
                             ours_rss=result[ours].get("peak_rss", result["aiayn"].get("peak_rss")),
                             peer_rss=result[peer].get("peak_rss"),
                             compile_s=result[ours].get("compile_s")))
    if bf16:  # MFU is against the fp32 peak: not given for the bf16 row
        rows.append(dict(benchmark="lm train step (bf16)", shape=shape, ours="aiayn", peer="hf",
                         metric="tokens/s", ours_value=result["aiayn-bf16"]["tokens_per_s"],
                         peer_value=result["hf-bf16"]["tokens_per_s"],
                         ours_rss=result["aiayn-bf16"].get("peak_rss"),
                         peer_rss=result["hf-bf16"].get("peak_rss")))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--memory", metavar="SIDE")
    args = parser.parse_args(argv)
    if args.memory:
        memory_main(lambda side: build_sides(args.d_model, [side])[side], args.memory, steps=3)
        return
    for row in run(args.d_model, compile_ours=args.compile, rounds=args.rounds):
        compiled = (f"  (torch.compile: first two steps {row['compile_s']:.0f} s)"
                    if row.get("compile_s") else "")
        print(f"{row['ours']:>14} vs {row['peer']:<8} {row['ours_value']:8.0f} vs "
              f"{row['peer_value']:8.0f} tokens/s  ratio {row['ours_value'] / row['peer_value']:.3f}"
              f"  peak RSS MiB {mib(row.get('ours_rss'))} vs {mib(row.get('peer_rss'))}"
              f"{compiled}")


if __name__ == "__main__":
    main(sys.argv[1:])
