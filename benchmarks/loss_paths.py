"""The CPU training loss with and without its chunked path, side by side in one process.

    python3 benchmarks/loss_paths.py [--rounds 10]

aiayn's training losses score the hidden states in row chunks on a CPU (``aiayn.training.
chunked_loss``) instead of materialising the (N, V) logits. This times whole training steps (loss,
backward, fused Adam) of the suite's two training rows with each path, alternating, and prints the
medians and their ratio (plain / chunked: > 1 means the chunked path is faster). Both paths give
the same loss and gradients (tests/test_chunked_loss.py).

- LM: decoder-only d256, 4 layers, vocabulary 8192, batch 8 x 256 (benchmarks/lm_train.py);
- enc-dec: d256, 3 + 3 layers, vocabulary 8192, batch 16, 64 + 64 tokens, label smoothing 0.1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import alternate, setup

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn.tasks import lm, translation
from aiayn.training import chunked_loss


def _step(model, loss_of):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss_of().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _with_path(chunked: bool, step):
    """``step`` with the chunked path forced on or off for the call."""
    def run():
        with mock.patch.object(chunked_loss, "chunks_loss", lambda hidden: chunked), \
                mock.patch.object(lm, "chunks_loss", lambda hidden: chunked):
            step()
    return run


def sides(row: str) -> dict:
    torch.manual_seed(0)
    if row == "lm":
        model = CausalLM(TransformerConfig(
            vocab_size=8192, d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=0,
            n_decoder_layers=4, max_length=512, dropout=0.0, activation="gelu_tanh",
            norm_first=True, positions="learned", scale_embeddings=False, init_std=0.02))
        ids = torch.randint(0, 8192, (8, 257))
        step = _step(model, lambda: lm.token_loss(model, ids[:, :-1], ids[:, 1:]) / ids.numel())
    else:
        model = Transformer(TransformerConfig(vocab_size=8192, d_model=256, n_heads=4, d_ff=1024,
                                              n_encoder_layers=3, n_decoder_layers=3,
                                              max_length=512, dropout=0.0))
        src, tgt = torch.randint(3, 8192, (16, 64)), torch.randint(3, 8192, (16, 65))
        step = _step(model, lambda: translation.translation_loss(
            model, src, tgt[:, :-1], tgt[:, 1:], smoothing=0.1) / tgt.numel())
    return {"chunked": _with_path(True, step), "plain": _with_path(False, step)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    setup()
    for row in ("lm", "seq2seq"):
        timing = alternate(sides(row), rounds=args.rounds, warmup=2)
        chunked, plain = timing.median("chunked"), timing.median("plain")
        print(f"{row:<8} chunked {chunked * 1000:8.1f} ms  plain {plain * 1000:8.1f} ms  "
              f"plain / chunked {plain / chunked:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
