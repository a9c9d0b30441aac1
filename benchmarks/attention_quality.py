"""Quality side by side: validation loss of a small character-level CausalLM on shakespeare_tiny.txt
trained for the same steps with dense (fused SDPA), linear and sparse attention.

Same data order, same initial weights (one seed), same optimiser for every kernel; only
``config.attention`` differs. A minimal loop (AdamW, linear warm-up then constant LR), because the
shared training engine was not on a branch this work could build on yet. This is a small,
short-training comparison, not a converged one: it shows how much each approximation costs early in
training on short contexts (block 256), where dense attention is cheap anyway.

Run:  PYTHONPATH=src python3 benchmarks/attention_quality.py --steps 300 \
          --json benchmarks/results/attention_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn import CausalLM, TransformerConfig

DATA = Path("/work/shared/data/shakespeare_tiny.txt")


def load_corpus(path: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Character ids of the first 90% (train) and the last 10% (validation); ids start at 3 so the
    special tokens 0-2 of the config stay unused."""
    text = path.read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"{path}: empty corpus")
    alphabet = sorted(set(text))
    index = {char: i + 3 for i, char in enumerate(alphabet)}
    ids = torch.tensor([index[char] for char in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:], len(alphabet) + 3


def batches(ids: torch.Tensor, block: int, batch: int, seed: int):
    """Endless random windows (B, block + 1), the same sequence for every kernel."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - block - 1, (batch,), generator=generator)
        yield torch.stack([ids[s: s + block + 1] for s in starts.tolist()])  # (B, block + 1)


@torch.no_grad()
def validation_loss(model: CausalLM, ids: torch.Tensor, block: int, max_windows: int) -> float:
    """Mean next-token cross-entropy over consecutive non-overlapping windows of the held-out text."""
    model.eval()
    windows = min(max_windows, (len(ids) - 1) // block)
    total, count = 0.0, 0
    for first in range(0, windows, 16):
        rows = [ids[w * block: w * block + block + 1] for w in range(first, min(first + 16, windows))]
        chunk = torch.stack(rows)  # (B, block + 1)
        logits = model(chunk[:, :-1])  # (B, block, V)
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def train_one(attention: str, args, train_ids, val_ids, vocab_size: int) -> dict:
    config = TransformerConfig(
        vocab_size=vocab_size, d_model=args.d_model, n_heads=args.heads, d_ff=4 * args.d_model,
        n_encoder_layers=0, n_decoder_layers=args.layers, max_length=args.block, dropout=0.0,
        norm_first=True, positions="learned", attention=attention, attention_window=args.window,
        attention_stride=args.stride, attention_chunk_size=64)
    torch.manual_seed(args.seed)  # same initial weights for every kernel
    model = CausalLM(config)
    optimiser = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    history = []
    data = batches(train_ids, args.block, args.batch, args.seed)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        for group in optimiser.param_groups:
            group["lr"] = args.lr * min(1.0, step / args.warmup)
        chunk = next(data)
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        if step % args.eval_every == 0 or step == args.steps:
            val = validation_loss(model, val_ids, args.block, args.val_windows)
            history.append({"step": step, "train_loss": loss.item(), "val_loss": val})
            print(f"{attention:>8} step {step:5d}  train {loss.item():.3f}  val {val:.3f}  "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    return {"attention": attention, "history": history, "val_loss": history[-1]["val_loss"],
            "val_bits_per_char": history[-1]["val_loss"] / math.log(2),
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--kernels", nargs="+", default=["fused", "linear", "sparse"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=32, help="sparse: local window")
    parser.add_argument("--stride", type=int, default=32, help="sparse: stride")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--val-windows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    train_ids, val_ids, vocab_size = load_corpus(args.data)
    results = [train_one(name, args, train_ids, val_ids, vocab_size) for name in args.kernels]
    print("\nattention | val loss (nats/char) | bits/char | train s")
    for r in results:
        print(f"{r['attention']:>9} | {r['val_loss']:20.4f} | {r['val_bits_per_char']:9.3f} | "
              f"{r['seconds']:7.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"settings": vars(args) | {"data": str(args.data),
                                                             "json": str(args.json)},
                                   "vocab_size": vocab_size, "results": results}, indent=2) + "\n")
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
