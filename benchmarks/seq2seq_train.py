"""Training step of an encoder-decoder: aiayn Transformer vs torch.nn.Transformer vs HF MarianMTModel.

The paper's base shapes scaled down (d_model 256, 4 heads, d_ff 1024, 3+3 layers, source and target 64,
batch 16). Each aiayn model takes its peer's weights: ``load_torch_transformer`` for torch.nn (plus the
shared embedding), the interop name map for Marian. Full-length batches (no padding) on every side.
Same AdamW settings everywhere; each side uses its own library's loss path and AdamW implementation
(aiayn: ``translation_loss`` + the trainer's ``make_optimizer``; HF: the Trainer's fused AdamW;
torch.nn: ``torch.optim.AdamW`` as written by a user; see ``common``).

    python3 benchmarks/seq2seq_train.py
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common import (aiayn_optimizer, alternate, memory_main, mib, peak_rss_subprocess,
                    peer_optimizer, setup)
from peers import aiayn_from_hf, hf_marian, matmul_flops_per_token, sinusoid

from aiayn import Transformer
from aiayn.interop.torch_nn import config_from_torch, load_torch_transformer
from aiayn.tasks.translation import translation_loss

D_MODEL, HEADS, D_FF, LAYERS, LENGTH, BATCH, VOCAB = 256, 4, 1024, 3, 64, 16, 8192


class TorchSeq2Seq(nn.Module):
    """What a torch user writes: shared embedding * sqrt(D) + sinusoid, nn.Transformer, tied generator."""

    def __init__(self, *, vocab: int = VOCAB, d_model: int = D_MODEL, heads: int = HEADS,
                 layers: int = LAYERS, d_ff: int = D_FF):
        super().__init__()
        self.vocab, self.d_model = vocab, d_model
        self.embedding = nn.Embedding(vocab, d_model)
        self.register_buffer("positions", sinusoid(512, d_model), persistent=False)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, d_ff, dropout=0.0,
                                          batch_first=True)

    def embed(self, ids: Tensor) -> Tensor:
        return self.embedding(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]]

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        hidden = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal,
                                  tgt_is_causal=True)
        return F.linear(hidden, self.embedding.weight)  # (B, T, V)


def aiayn_from_torch(peer: TorchSeq2Seq) -> Transformer:
    config = config_from_torch(peer.transformer, vocab_size=peer.vocab, sinusoid_layout="split",
                               max_length=512, dropout=0.0)
    model = Transformer(config)
    load_torch_transformer(peer.transformer, model)
    with torch.no_grad():
        model.encoder.embeddings.tokens.weight.copy_(peer.embedding.weight)  # shared and tied
    return model


def build_sides(which: list[str]) -> dict:
    torch.manual_seed(0)
    src = torch.randint(3, VOCAB, (BATCH, LENGTH))
    tgt = torch.randint(3, VOCAB, (BATCH, LENGTH + 1))
    tgt_in, tgt_out = tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()
    peers = {}
    sides = {}
    for name in which:
        if name in ("torch.nn", "aiayn<-torch.nn"):
            peer = peers.setdefault("torch", TorchSeq2Seq().train())
            model = peer if name == "torch.nn" else aiayn_from_torch(peer).train()
            sides[name] = (_step(model, _peer_loss(lambda m: m(src, tgt_in), tgt_out),
                                 peer_optimizer(model, fused=False)) if name == "torch.nn" else
                           _step(model, _aiayn_loss(src, tgt_in, tgt_out), aiayn_optimizer(model)))
        elif name in ("marian", "aiayn<-marian"):
            peer = peers.setdefault("marian", hf_marian(
                d_model=D_MODEL, layers=LAYERS, heads=HEADS, d_ff=D_FF, vocab=VOCAB,
                positions=512).train())
            if name == "marian":
                sides[name] = _step(peer, _peer_loss(
                    lambda m: m(input_ids=src, decoder_input_ids=tgt_in).logits, tgt_out),
                    peer_optimizer(peer, fused=True))
            else:
                model = aiayn_from_hf(peer).train()
                sides[name] = _step(model, _aiayn_loss(src, tgt_in, tgt_out), aiayn_optimizer(model))
    return sides


def _peer_loss(logits_of, targets):
    def loss_of(model):
        logits = logits_of(model)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss_of


def _aiayn_loss(src, tgt_in, tgt_out):
    """aiayn's own translation training loss (``translation_loss``, no smoothing) as a mean."""
    return lambda model: translation_loss(model, src, tgt_in, tgt_out) / tgt_out.numel()


def _step(model, loss_of, optimizer):
    """One training step; optimizers as in ``common`` (each library's own choice on CPU)."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model)
        loss.backward()
        optimizer.step()
        return loss

    return step


def run(*, rounds: int = 6, memory: bool = True) -> list[dict]:
    setup()
    names = ["aiayn<-torch.nn", "torch.nn", "aiayn<-marian", "marian"]
    timing = alternate(build_sides(names), rounds=rounds, warmup=2)
    tokens = BATCH * LENGTH  # target tokens per step (the unit of the paper's batches)
    flops = (matmul_flops_per_token(D_MODEL, LAYERS, D_FF, 0, LENGTH)
             + matmul_flops_per_token(D_MODEL, LAYERS, D_FF, VOCAB, LENGTH, cross=True)) * tokens
    rss = {name: peak_rss_subprocess("seq2seq_train.py", name) if memory else None for name in names}
    rows = []
    for ours, peer in (("aiayn<-torch.nn", "torch.nn"), ("aiayn<-marian", "marian")):
        rows.append(dict(benchmark="enc-dec train step",
                         shape=f"d{D_MODEL} {LAYERS}+{LAYERS} S=T{LENGTH} B{BATCH} V{VOCAB}",
                         ours=ours, peer=peer, metric="target tokens/s",
                         ours_value=tokens / timing.median(ours), peer_value=tokens / timing.median(peer),
                         ours_gflops=flops / timing.median(ours) / 1e9,
                         peer_gflops=flops / timing.median(peer) / 1e9,
                         ours_rss=rss[ours], peer_rss=rss[peer]))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--memory", metavar="SIDE")
    args = parser.parse_args(argv)
    if args.memory:
        memory_main(lambda side: build_sides([side])[side], args.memory, steps=3)
        return
    for row in run(rounds=args.rounds):
        print(f"{row['ours']:>16} vs {row['peer']:<9} {row['ours_value']:8.0f} vs "
              f"{row['peer_value']:8.0f} tokens/s  ratio {row['ours_value'] / row['peer_value']:.3f}"
              f"  peak RSS MiB {mib(row.get('ours_rss'))} vs {mib(row.get('peer_rss'))}")


if __name__ == "__main__":
    main(sys.argv[1:])
