"""A small ViT against scikit-learn's classic classifiers and a small CNN on the 8x8 digits.

Every model sees the same images: ``sklearn.datasets.load_digits`` split by
``aiayn.data.images.split_images`` with ``DIGITS_SPLIT`` (70 / 10 / 20 per class, seed 0), the
split ``aiayn train image-classification`` uses by default. The ViT is trained by that command
with its defaults (one run per seed); logistic regression and the RBF SVM have their C (and gamma)
chosen on the validation images, as the ViT run picks its best checkpoint on them; the CNN (two
3x3 convolutions, 32 and 64 channels, max-pool, a linear head) is trained with the ViT's optimiser,
schedule, batches and steps. Test images are scored once per model.

    python3 benchmarks/digits_vit_vs_sklearn.py [--seeds 0 1 2] [--threads 2] [--steps 1500]
        [--out runs/bench]

Prints the command, a table (test accuracy, macro-F1, wall seconds) and writes a JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from aiayn.commands.train_image_classification import DEFAULTS  # noqa: E402
from aiayn.data.images import (DIGITS, DIGITS_SPLIT, load_digits, normalise,  # noqa: E402
                               split_images)
from aiayn.data.labels import LabelMap  # noqa: E402
from aiayn.tasks.classification_metrics import classification_report  # noqa: E402


def sklearn_baselines(parts, labels: LabelMap) -> list[dict]:
    """Logistic regression and an RBF SVM on the raw pixels / 16, C (and gamma) chosen on valid."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import SVC

    x = {name: part.images.reshape(len(part), -1).numpy() for name, part in parts.items()}
    y = {name: [labels.index(label) for label in part.labels] for name, part in parts.items()}
    grids = {
        "logistic regression": [dict(C=c) for c in (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)],
        "RBF SVM": [dict(C=c, gamma=g) for c in (1.0, 10.0, 100.0)
                    for g in ("scale", 0.01, 0.03, 0.1)],
    }
    results = []
    for name, grid in grids.items():
        start = time.perf_counter()
        best = None
        for params in grid:
            model = (LogisticRegression(max_iter=5000, **params) if name.startswith("logistic")
                     else SVC(kernel="rbf", **params))
            model.fit(x["train"], y["train"])
            valid = classification_report(y["valid"], model.predict(x["valid"]).tolist(),
                                          labels.names)
            if best is None or valid.accuracy > best[1].accuracy:
                best = (params, valid, model)
        params, valid, model = best
        test = classification_report(y["test"], model.predict(x["test"]).tolist(), labels.names)
        results.append({"model": name, "params": params, "valid_accuracy": valid.accuracy,
                        "test_accuracy": test.accuracy, "test_macro_f1": test.macro_f1,
                        "seconds": time.perf_counter() - start})
    return results


def train_vit(seed: int, out: Path, threads: int, steps: int) -> dict:
    """``aiayn train image-classification`` with its defaults but ``steps``; its test scores."""
    from aiayn.cli import main
    from aiayn.commands.train_image_classification import evaluation_images
    from aiayn.tasks.image_classification import score
    from aiayn.training.run import load_run

    run_dir = out / f"vit-seed{seed}"
    command = ["train", "image-classification", "--out", str(run_dir), "--seed", str(seed),
               "--threads", str(threads), "--no-progress", "--no-resume"]
    if steps != DEFAULTS["steps"]:
        command += ["--steps", str(steps)]
    start = time.perf_counter()
    if main(command) != 0:
        raise SystemExit(f"aiayn {' '.join(command)} failed")
    seconds = time.perf_counter() - start
    run = load_run(run_dir)
    test, _ = evaluation_images(DIGITS, run, "test")
    report, _ = score(run.model, run.assets, test)
    return {"model": f"aiayn ViT (vit-digits), seed {seed}",
            "command": "aiayn " + " ".join(command),
            "valid_accuracy": run.info.get("weights_metrics", {}).get("accuracy"),
            "test_accuracy": report.accuracy, "test_macro_f1": report.macro_f1,
            "seconds": seconds, "weights": run.info.get("weights_source")}


class SmallCNN(nn.Module):
    """(B, 1, 8, 8) -> (B, K): conv 3x3 (32), ReLU, conv 3x3 (64), ReLU, max-pool 2, linear."""

    def __init__(self, classes: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(64 * 4 * 4, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))  # (B, 64 * 4 * 4) -> (B, K)


def train_cnn(seed: int, parts, labels: LabelMap, steps: int) -> dict:
    """The CNN with the ViT command's optimiser, schedule, batches, steps and best-on-valid pick."""
    from aiayn.tasks.image_classification import ImageClassificationTask, predict_probabilities
    from aiayn.training import Schedule

    torch.manual_seed(seed)
    task = ImageClassificationTask(train=parts["train"], valid=parts["valid"], labels=labels,
                                   seed=seed)
    model = SmallCNN(len(labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULTS["lr"], betas=DEFAULTS["betas"],
                                  eps=DEFAULTS["adam_eps"], weight_decay=DEFAULTS["weight_decay"])
    schedule = Schedule(kind="warmup_cosine", d_model=64, warmup=DEFAULTS["warmup"],
                        peak=DEFAULTS["lr"], total=steps, floor=DEFAULTS["min_lr"])
    start, step, epoch, best = time.perf_counter(), 0, 0, (-1.0, None)
    while step < steps:
        for batch in task.train_batches(epoch):
            step += 1
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            loss = task.loss(model, batch) / batch.size
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), DEFAULTS["clip_norm"])
            optimizer.step()
            if step % DEFAULTS["eval_every"] == 0 or step == steps:
                model.eval()
                accuracy = task.evaluate(model)["accuracy"]
                model.train()
                if accuracy > best[0]:
                    best = (accuracy, {k: v.clone() for k, v in model.state_dict().items()})
            if step == steps:
                break
        epoch += 1
    model.load_state_dict(best[1])
    model.eval()
    test = parts["test"]
    images = normalise(test.images, task.mean, task.std)  # (N, 1, 8, 8), as the ViT sees them
    predicted = predict_probabilities(model, images).argmax(-1).tolist()
    report = classification_report([labels.index(label) for label in test.labels], predicted,
                                   labels.names)
    return {"model": f"small CNN ({sum(p.numel() for p in model.parameters()):,} parameters), "
                     f"seed {seed}", "valid_accuracy": best[0], "test_accuracy": report.accuracy,
            "test_macro_f1": report.macro_f1, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                        help="training steps of the ViT and the CNN (default: the command's)")
    parser.add_argument("--out", default="runs/digits-bench", help="where the ViT runs go")
    parser.add_argument("--json", default="benchmarks/results/digits_vit_vs_sklearn.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python3 " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    print(f"command: {command}")
    parts = split_images(load_digits(), **DIGITS_SPLIT)
    labels = LabelMap.from_labels(parts["train"].labels)
    print(f"data: {DIGITS}: " + " / ".join(f"{len(p)} {n}" for n, p in parts.items()) + " images")
    rows = sklearn_baselines(parts, labels)
    for seed in args.seeds:
        rows.append(train_vit(seed, Path(args.out), args.threads, args.steps))
        rows.append(train_cnn(seed, parts, labels, args.steps))
    print(f"\n{'model':<48} {'valid acc':>9} {'test acc':>9} {'test F1':>8} {'seconds':>8}")
    for row in rows:
        valid = f"{row['valid_accuracy']:.4f}" if row["valid_accuracy"] is not None else "-"
        print(f"{row['model']:<48} {valid:>9} {row['test_accuracy']:>9.4f} "
              f"{row['test_macro_f1']:>8.4f} {row['seconds']:>8.1f}")
    for kind in ("aiayn ViT", "small CNN"):
        scores = [row["test_accuracy"] for row in rows if row["model"].startswith(kind)]
        if len(scores) > 1:
            print(f"{kind}: test accuracy mean {statistics.mean(scores):.4f}, min "
                  f"{min(scores):.4f}, max {max(scores):.4f} over {len(scores)} seeds")
    result = {"command": command, "split": DIGITS_SPLIT, "threads": args.threads,
              "images": {name: len(part) for name, part in parts.items()}, "rows": rows}
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
