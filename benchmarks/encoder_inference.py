"""Encoder inference under torch.inference_mode: aiayn TransformerEncoder vs HF BertModel.

all-MiniLM-L6-v2's shapes (d_model 384, 12 heads, d_ff 1536, 6 layers, vocabulary 30522), sequence 128,
batch 32, random weights copied from the HF model into aiayn. Two inputs: full-length rows (no mask) and
a padded batch (lengths 96..128, 13 % of the positions padding) with its attention mask on both sides;
and, on CPUs with native bf16 kernels, the full rows again under CPU bf16 autocast on both sides.

    python3 benchmarks/encoder_inference.py
"""

from __future__ import annotations

import argparse
import sys

import torch

from common import (alternate, cpu_bf16_supported, memory_main, peak_rss_subprocess, setup,
                    under_bf16_autocast)
from peers import aiayn_from_hf, hf_bert, matmul_flops_per_token

D_MODEL, HEADS, D_FF, LAYERS, VOCAB, LENGTH, BATCH = 384, 12, 1536, 6, 30522, 128, 32


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The padded input: ids (B, T) and mask (B, T), True = real token, lengths 96..128."""
    torch.manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH))
    lengths = torch.randint(LENGTH * 3 // 4, LENGTH + 1, (BATCH,))
    lengths[0] = LENGTH * 3 // 4
    mask = torch.arange(LENGTH) < lengths[:, None]  # (B, T) True = real token
    return ids.masked_fill(~mask, 0), mask


def build_sides(which: list[str], padded: bool = False, bf16: bool = False) -> dict:
    """side name -> forward call; ``bf16``: every side under CPU bf16 autocast."""
    if padded:
        ids, mask = padded_batch()  # seeds 0 itself
    else:
        torch.manual_seed(0)
        ids, mask = torch.randint(1, VOCAB, (BATCH, LENGTH)), None
    hf = hf_bert(d_model=D_MODEL, layers=LAYERS, heads=HEADS, d_ff=D_FF, vocab=VOCAB,
                 positions=512).eval()
    sides = {}
    for name in which:
        if name == "aiayn":
            model = aiayn_from_hf(hf).eval()

            def call(model=model):
                with torch.inference_mode():
                    return model(ids, padding_mask=mask)
        else:
            hf_mask = None if mask is None else mask.long()

            def call(model=hf):
                with torch.inference_mode():
                    return model(input_ids=ids, attention_mask=hf_mask).last_hidden_state
        sides[name] = under_bf16_autocast(call) if bf16 else call
    return sides


def run(*, rounds: int = 8, memory: bool = True) -> list[dict]:
    setup()
    rows = []
    tokens = BATCH * LENGTH
    flops = matmul_flops_per_token(D_MODEL, LAYERS, D_FF, 0, LENGTH) / 3 * tokens  # forward only
    # (padded, bf16): the bf16 autocast row only where the CPU has native bf16 kernels
    settings = [(False, False), (True, False)] + ([(False, True)] if cpu_bf16_supported() else [])
    for padded, bf16 in settings:
        sides = build_sides(["aiayn", "hf"], padded, bf16)
        out_ours, out_peer = sides["aiayn"](), sides["hf"]()
        if not padded:
            difference = (out_ours.float() - out_peer.float()).abs().max().item()
            assert difference < (5e-2 if bf16 else 1e-3), f"aiayn and BERT differ by {difference}"
        timing = alternate(sides, rounds=rounds, warmup=2)
        flags = ["--padded"] * padded + ["--bf16"] * bf16
        rss = ({name: peak_rss_subprocess("encoder_inference.py", name, flags)
                for name in ("aiayn", "hf")} if memory else {"aiayn": None, "hf": None})
        label = "encoder inference" + (" (padded)" if padded else "") + (" (bf16)" if bf16 else "")
        # MFU is against the fp32 peak: not given for the bf16 row
        rows.append(dict(benchmark=label,
                         shape=f"d{D_MODEL} L{LAYERS} T{LENGTH} B{BATCH}", ours="aiayn", peer="hf-bert",
                         metric="tokens/s", ours_value=tokens / timing.median("aiayn"),
                         peer_value=tokens / timing.median("hf"),
                         ours_gflops=None if bf16 else flops / timing.median("aiayn") / 1e9,
                         peer_gflops=None if bf16 else flops / timing.median("hf") / 1e9,
                         ours_rss=rss["aiayn"], peer_rss=rss["hf"]))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--memory", metavar="SIDE")
    parser.add_argument("--padded", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="(--memory) under bf16 autocast")
    args = parser.parse_args(argv)
    if args.memory:
        memory_main(lambda side: build_sides([side], args.padded, args.bf16)[side], args.memory,
                    steps=3)
        return
    for row in run(rounds=args.rounds):
        print(f"{row['benchmark']:<28} {row['ours_value']:8.0f} vs {row['peer_value']:8.0f} tokens/s"
              f"  ratio {row['ours_value'] / row['peer_value']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
