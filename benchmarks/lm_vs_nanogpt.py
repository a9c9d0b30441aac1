"""Training-step speed: ``aiayn train lm --preset baby-gpt`` against nanoGPT's baby GPT, one process.

Ours is the real thing: ``aiayn.training.train`` on ``LanguageModelTask`` with the baby-gpt preset and
the CLI's LM defaults (AdamW, decay on matrices, warm-up + cosine, clipping at 1.0), in a fresh run
directory each round, evaluation replaced by a constant (we time training, not validation).
Steady-state time per iteration is measured from the first to the last call of the task's loss (so
model building, run.json and the final checkpoint write are left out; everything the loop does
between two steps is in), and likewise from the first to the last iteration of nanoGPT's loop.

The peer is a faithful minimal copy of nanoGPT's ``model.py`` (LayerNorm without bias, fused c_attn,
SDPA ``is_causal``, GELU MLP, tied lm_head, N(0, 0.02) init with scaled c_proj, AdamW with decay on
2-D parameters, ``fused=False`` on CPU) and of the body of its ``train.py`` loop for the CPU command
of its README (``get_batch`` from a uint16 memmap re-opened per batch, the cosine ``get_lr``,
``loss.item()`` every iteration as with ``--log_interval=1``, clipping at 1.0, zero_grad(set_to_none)).

Rounds alternate ours / nanoGPT with the same threads; each round trains a fresh model for
``--steps`` steps. Prints the median ms/iteration of each and the ratio ours/nanoGPT, and writes JSON.

    python3 benchmarks/lm_vs_nanogpt.py --rounds 5 --steps 100 --json benchmarks/results/lm_vs_nanogpt.json

``--quality`` measures the peer's validation loss instead: nanoGPT's loop trains ``--quality-steps``
iterations (its README's CPU command: eval_interval 250, eval_iters 20) per ``--seeds`` seed, on the
LM task's own split of ``--data`` (same character vocabulary, first 90 % / last 10 %), sampling batches
as nanoGPT does (``torch.manual_seed(seed)``, random windows of a uint16 memmap; the periodic
``estimate_loss`` calls draw from the same generator, as in train.py). The trained model is then scored
by ``LanguageModelTask.evaluate`` itself -- the whole validation split in contiguous non-overlapping
64-character blocks, every target once -- so its loss compares with ``aiayn train lm``'s.

    python3 benchmarks/lm_vs_nanogpt.py --quality --threads 1 --json /tmp/nanogpt_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from aiayn.config import TransformerConfig  # noqa: E402
from aiayn.tasks.lm import LanguageModelTask  # noqa: E402
from aiayn.training import Schedule, TrainingConfig, train  # noqa: E402

BLOCK, BATCH, LAYERS, HEADS, WIDTH = 64, 12, 4, 4, 128
LR, MIN_LR, WARMUP, DECAY_ITERS = 1e-3, 1e-4, 100, 2000


# ---------------------------------------------------------------- nanoGPT (model.py, minimal copy)
class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH,
                 bias=False):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0), h=nn.ModuleList([Block(n_embd, n_head, bias)
                                                   for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=False)


def nanogpt_lr(it):
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY_ITERS:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def run_nanogpt(train_bin: Path, vocab_size: int, steps: int, seed: int) -> float:
    """Seconds per iteration of nanoGPT's loop (fresh model), first to last iteration."""
    torch.manual_seed(seed)

    def get_batch():
        data = np.memmap(train_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - BLOCK, (BATCH,))
        x = torch.stack([torch.from_numpy((data[i:i + BLOCK]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + BLOCK]).astype(np.int64))
                         for i in ix])
        return x, y

    model = GPT(vocab_size)
    optimizer = model.configure_optimizers(0.1, LR, (0.9, 0.99))
    X, Y = get_batch()
    stamps = []
    for iter_num in range(steps):
        stamps.append(time.perf_counter())
        lr = nanogpt_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        logits, loss = model(X, Y)
        X, Y = get_batch()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # log_interval=1
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


# ---------------------------------------------------------------- nanoGPT's validation loss (--quality)
EVAL_INTERVAL, EVAL_ITERS = 250, 20  # config/train_shakespeare_char.py; --eval_iters=20 (its README)


class FullLogits(nn.Module):
    """The nanoGPT copy as a plain ``inputs (B, T) -> logits (B, T, V)`` module, the interface
    ``aiayn.tasks.lm.token_loss`` scores for any module that is not a ``CausalLM``."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx):
        # The copy's forward always scores targets (nanoGPT's targets=None path keeps only the last
        # position): pass dummy ones and keep the logits of every position.
        logits, _ = self.gpt(idx, torch.zeros_like(idx))
        return logits  # (B, T, V)


def train_nanogpt(train_bin: Path, val_bin: Path, vocab_size: int, steps: int, seed: int):
    """nanoGPT's train.py loop for ``steps`` updates; returns the model, its ``estimate_loss``
    figures by iteration (the last one after ``steps`` updates, as train.py prints at max_iters)
    and the seconds the loop took."""
    torch.manual_seed(seed)

    def get_batch(split):
        data = np.memmap(train_bin if split == "train" else val_bin, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - BLOCK, (BATCH,))
        x = torch.stack([torch.from_numpy((data[i:i + BLOCK]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + BLOCK]).astype(np.int64))
                         for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(EVAL_ITERS)
            for k in range(EVAL_ITERS):
                X, Y = get_batch(split)
                logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    model = GPT(vocab_size)
    optimizer = model.configure_optimizers(0.1, LR, (0.9, 0.99))
    start = time.perf_counter()
    X, Y = get_batch("train")
    estimates = {}
    for iter_num in range(steps + 1):
        lr = nanogpt_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0 or iter_num == steps:
            estimates[iter_num] = estimate_loss()
            print(f"  step {iter_num}: train loss {estimates[iter_num]['train']:.4f}, "
                  f"val loss {estimates[iter_num]['val']:.4f}", flush=True)
        if iter_num == steps:  # train.py evaluates at max_iters, then takes one more step unused
            break
        logits, loss = model(X, Y)
        X, Y = get_batch("train")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # log_interval=1
    return model, estimates, time.perf_counter() - start


def _shown(path: Path) -> str:
    """A path as a reader of the JSON types it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run_quality(args: argparse.Namespace, command: str) -> int:
    """Train nanoGPT per seed, score it on the whole validation split as aiayn does; table + JSON."""
    task = LanguageModelTask(args.data, batch_size=BATCH, block_size=BLOCK, device="cpu")
    vocab_size = len(task.vocabulary)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        train_bin, val_bin = Path(tmp) / "train.bin", Path(tmp) / "val.bin"
        np.asarray(task.train_ids, dtype=np.uint16).tofile(train_bin)
        np.asarray(task.valid_ids, dtype=np.uint16).tofile(val_bin)
        for seed in args.seeds:
            print(f"seed {seed}: {args.quality_steps} iterations", flush=True)
            model, estimates, seconds = train_nanogpt(train_bin, val_bin, vocab_size,
                                                      args.quality_steps, seed)
            start = time.perf_counter()
            metrics = task.evaluate(FullLogits(model))  # aiayn's own evaluation, whole split
            rows.append({"seed": seed, "steps": args.quality_steps,
                         "val_loss": metrics["loss"], "val_bpc": metrics["bpc"],
                         "val_tokens": int(metrics["tokens"]),
                         "estimate_val_loss": estimates[args.quality_steps]["val"],
                         "estimate_train_loss": estimates[args.quality_steps]["train"],
                         "seconds": seconds, "eval_seconds": time.perf_counter() - start,
                         "estimates": {str(k): v for k, v in estimates.items()}})
    losses = [row["val_loss"] for row in rows]
    result = {"command": command, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "data": _shown(Path(args.data)), "vocab_size": vocab_size,
              "train_tokens": len(task.train_ids), "valid_tokens": len(task.valid_ids),
              "evaluation": f"LanguageModelTask.evaluate: whole validation split, contiguous "
                            f"non-overlapping blocks of {BLOCK}, every target once",
              "estimate": f"nanoGPT estimate_loss: mean of {EVAL_ITERS} random val batches of "
                          f"{BATCH}x{BLOCK}",
              "mean_val_loss": statistics.fmean(losses), "seeds": rows}
    print(f"{'seed':>6} {'steps':>6} {'val loss (whole split)':>23} {'estimate (20 batches)':>22} "
          f"{'seconds':>8}")
    for row in rows:
        print(f"{row['seed']:>6} {row['steps']:>6} {row['val_loss']:>23.4f} "
              f"{row['estimate_val_loss']:>22.4f} {row['seconds']:>8.1f}")
    print(f"mean whole-split val loss {result['mean_val_loss']:.4f} nats/char")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ---------------------------------------------------------------- ours (the real engine)
class TimedTask(LanguageModelTask):
    """The LM task with validation replaced by a constant: this benchmark times training only."""

    stamps: list[float] = []

    def evaluate(self, model):  # every metric the task declares (the trainer checks them)
        return dict.fromkeys(self.metric_names(), 0.0)

    def loss(self, model, batch):
        self.stamps.append(time.perf_counter())
        return super().loss(model, batch)


def run_ours(task: TimedTask, steps: int, seed: int, workdir: Path) -> float:
    """Seconds per iteration of the engine (fresh model), first to last step."""
    config = TransformerConfig.preset("baby-gpt")
    task.stamps = []
    model_config = task.model_config(config)
    torch.manual_seed(seed)
    model = task.build_model(model_config)
    training = TrainingConfig(
        steps=steps, optimizer="adamw", betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
        decay_matrices_only=True, clip_norm=1.0, eval_every=0, save_every=0, log_every=10,
        keep_last=1, progress=False, seed=seed, device="cpu",
        schedule=Schedule(kind="warmup_cosine", peak=LR, warmup=WARMUP, total=DECAY_ITERS,
                          floor=MIN_LR))
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    train(model, task, training, run_dir, model_config=model_config)
    return (task.stamps[-1] - task.stamps[0]) / (len(task.stamps) - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "data" / "shakespeare_tiny.txt.gz"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="training steps per round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quality", action="store_true",
                        help="measure nanoGPT's validation loss instead of timing both sides")
    parser.add_argument("--quality-steps", type=int, default=DECAY_ITERS,
                        help="nanoGPT iterations per seed with --quality")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 0],
                        help="torch.manual_seed of each --quality run (nanoGPT: 1337)")
    args = parser.parse_args(argv)
    if args.quality_steps < 1:
        parser.error(f"--quality-steps must be positive, got {args.quality_steps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quality:
        given = sys.argv[1:] if argv is None else argv
        return run_quality(args, shlex.join(["python3", "benchmarks/lm_vs_nanogpt.py", *given]))
    task = TimedTask(args.data, batch_size=BATCH, block_size=BLOCK, device="cpu")
    ours_ms, peer_ms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        train_bin = workdir / "train.bin"
        np.asarray(task.train_ids, dtype=np.uint16).tofile(train_bin)
        vocab_size = len(task.vocabulary)
        run_ours(task, 10, 0, workdir)  # warm-up both paths
        run_nanogpt(train_bin, vocab_size, 10, 0)
        for round_ in range(args.rounds):
            ours_ms.append(1000 * run_ours(task, args.steps, round_, workdir))
            peer_ms.append(1000 * run_nanogpt(train_bin, vocab_size, args.steps, round_))
            print(f"round {round_ + 1}: ours {ours_ms[-1]:.1f} ms/iter, nanoGPT "
                  f"{peer_ms[-1]:.1f} ms/iter", flush=True)
    ours, peer = statistics.median(ours_ms), statistics.median(peer_ms)
    ratios = [o / p for o, p in zip(ours_ms, peer_ms)]
    result = {"ours_ms_per_iter": ours, "nanogpt_ms_per_iter": peer, "ratio": ours / peer,
              "median_round_ratio": statistics.median(ratios), "rounds": args.rounds,
              "steps_per_round": args.steps, "threads": torch.get_num_threads(),
              "ours_all": ours_ms, "nanogpt_all": peer_ms, "torch": torch.__version__}
    print(f"median ms/iter: ours {ours:.1f}, nanoGPT {peer:.1f}, ratio ours/nanoGPT "
          f"{ours / peer:.3f} (median of per-round ratios {statistics.median(ratios):.3f})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
