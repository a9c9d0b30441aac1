"""Generation on the KV cache: aiayn vs HF ``generate``.

- greedy, decoder-only (the GPT-2 of lm_train.py: d_model 256, 4 layers, vocabulary 8192), prompt 16,
  256 new tokens, batch 1 and 8: new tokens/s; the token sequences must be identical;
- beam search (4 beams) on the encoder-decoder (the Marian of seq2seq_train.py), batch 4 sources of 32
  tokens, 32 new tokens, no end-of-sentence (fixed length on both sides): new tokens/s per source.

The aiayn side is ``aiayn.decoding.generation.generate`` (greedy) and the fixed-length beam loop over
the static cache written below (``beam_loop``); ``aiayn-loop`` is the plain greedy loop below;
``aiayn+compile`` runs the decoding steps of an ``aiayn.fast`` engine (each step one ``torch.compile``
graph; the time of its first call, compilation included, is reported; its peak memory includes what
compiling leaves resident: inductor's modules and generated code).

    python3 benchmarks/generation.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common import alternate, memory_main, peak_rss_subprocess, setup
from peers import aiayn_from_hf, hf_gpt2, hf_marian

PROMPT, NEW = 16, 256
# the sides whose peak memory is measured, each in its own process
MEMORY_SIDES = ("aiayn", "aiayn+compile", "hf")
SOURCE, BEAM_NEW, BEAM_BATCH, BEAMS = 32, 32, 4, 4


@torch.inference_mode()
def greedy_loop(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding over a static cache: no per-step allocation beyond the step's activations,
    no host sync (the next token stays a tensor)."""
    batch, length = prompt.shape
    out = torch.empty(batch, length + new_tokens, dtype=prompt.dtype)
    out[:, :length] = prompt
    cache = model.new_cache(batch, length + new_tokens)
    logits = model.lm_head(model.hidden_states(prompt, cache=cache)[:, -1])  # (B, V): last only
    for position in range(length, length + new_tokens):
        token = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        out[:, position: position + 1] = token
        if position + 1 < length + new_tokens:
            logits = model(token, cache=cache)[:, -1]
    return out


@torch.inference_mode()
def beam_loop(model, src: torch.Tensor, beams: int, new_tokens: int, *,
              step=None) -> torch.Tensor:
    """Fixed-length beam search (no EOS): the best of ``beams`` hypotheses per source, (B, 1 + new).

    The cache shares each source's cross-attention keys/values among its beams (``rows_per_memory``),
    so the memory is encoded, projected and kept once per source and never reordered; the self-attention
    cache reorders in place. Tokens and back-pointers go into preallocated (steps, B*K) buffers and
    the best hypothesis is traced back once at the end, so a step appends nothing. ``step``: runs the
    steps after the first (default ``aiayn.decoding.greedy.decoder_step``).
    """
    from aiayn.decoding.greedy import decoder_step

    step_logits = step or decoder_step
    batch = src.shape[0]
    config = model.config
    memory = model.encode(src)  # (B, S, D), once per source
    cache = model.new_cache(batch * beams, new_tokens + 1, rows_per_memory=beams)
    tokens = torch.full((batch * beams, 1), config.decoder_start_id, dtype=torch.long)
    scores = torch.zeros(batch, beams)
    scores[:, 1:] = float("-inf")  # all beams start identical: keep one
    chosen = torch.empty(new_tokens, batch * beams, dtype=torch.long)  # token of each row per step
    parents = torch.empty(new_tokens, batch * beams, dtype=torch.long)  # row it extends
    offsets = (torch.arange(batch) * beams)[:, None]  # (B, 1)
    for index in range(new_tokens):
        logits = (model.decode(tokens, memory, cache=cache)[:, -1] if index == 0
                  else step_logits(model, tokens, None, cache))
        log_probs = torch.log_softmax(logits, dim=-1)  # (B*K, V)
        vocab = log_probs.shape[-1]
        candidates = log_probs.add_(scores.view(-1, 1)).view(batch, beams * vocab)
        scores, flat = candidates.topk(beams, dim=-1)  # (B, K)
        origin = (flat // vocab + offsets).view(-1)  # (B*K,) rows that survive
        tokens = (flat % vocab).view(-1, 1)
        chosen[index], parents[index] = tokens[:, 0], origin
        cache.reorder(origin, cross=False)  # beams move within their source: memory is shared
    row = scores.argmax(dim=-1) + offsets[:, 0]  # (B,) best final row per source
    history = torch.empty(batch, new_tokens + 1, dtype=torch.long)
    history[:, 0] = config.decoder_start_id
    for step in range(new_tokens - 1, -1, -1):  # trace the back-pointers
        history[:, step + 1] = chosen[step, row]
        row = parents[step, row]
    return history


def _inference(call):
    with torch.inference_mode():
        return call()


def _engine(model):
    from aiayn.fast import InferenceOptions, prepare_for_inference

    return prepare_for_inference(model, InferenceOptions(compile=True))


def build_greedy(which: list[str], batch: int) -> dict:
    torch.manual_seed(0)
    hf = hf_gpt2(d_model=256, layers=4, heads=4, vocab=8192, positions=512).eval()
    prompt = torch.randint(1, 8192, (batch, PROMPT))
    from aiayn.decoding.generation import generate as library

    sides = {}
    for name in which:
        if name == "aiayn":
            model = aiayn_from_hf(hf).eval()
            sides[name] = lambda model=model: _inference(lambda: torch.tensor(
                library(model, prompt, max_new_tokens=NEW, greedy=True).tokens))
        elif name == "aiayn+compile":  # each decoding step through torch.compile
            engine = _engine(aiayn_from_hf(hf))
            sides[name] = lambda engine=engine: _inference(lambda: torch.tensor(
                engine.generate(prompt, max_new_tokens=NEW, greedy=True).tokens))
        elif name == "aiayn-loop":
            model = aiayn_from_hf(hf).eval()
            sides[name] = lambda model=model: greedy_loop(model, prompt, NEW)[:, PROMPT:]
        else:
            sides[name] = lambda: hf.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, num_beams=1,
                max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                eos_token_id=None)[:, PROMPT:]
    return sides


def build_beam(which: list[str]) -> dict:
    torch.manual_seed(0)
    hf = hf_marian(d_model=256, layers=3, heads=4, d_ff=1024, vocab=8192, positions=512).eval()
    src = torch.randint(3, 8192, (BEAM_BATCH, SOURCE))
    sides = {}
    for name in which:
        if name == "aiayn":
            model = aiayn_from_hf(hf).eval()
            sides[name] = lambda model=model: beam_loop(model, src, BEAMS, BEAM_NEW)
        elif name == "aiayn+compile":
            engine = _engine(aiayn_from_hf(hf))
            sides[name] = lambda engine=engine: beam_loop(engine.model, src, BEAMS, BEAM_NEW,
                                                          step=engine.decoder_step)
        else:
            sides[name] = lambda: hf.generate(
                src, attention_mask=torch.ones_like(src), num_beams=BEAMS, do_sample=False,
                max_new_tokens=BEAM_NEW, min_new_tokens=BEAM_NEW, eos_token_id=None,
                forced_eos_token_id=None, length_penalty=1.0, early_stopping=False,
                bad_words_ids=None, pad_token_id=0)
    return sides


def run(*, rounds: int = 5, memory: bool = True) -> list[dict]:
    setup()
    rows = []
    for batch in (1, 8):
        names = ["aiayn", "hf", "aiayn-loop", "aiayn+compile"]
        measured = [name for name in names if name in MEMORY_SIDES]
        sides = build_greedy(names, batch)
        reference = sides["hf"]()
        same, first_call = {}, {}
        for name in names:
            if name != "hf":
                began = time.perf_counter()
                same[name] = torch.equal(sides[name](), reference)
                first_call[name] = time.perf_counter() - began  # compiles the step: "aiayn+compile"
        timing = alternate(sides, rounds=rounds, warmup=1)
        rss = ({name: peak_rss_subprocess("generation.py", name, ["--greedy-batch", str(batch)])
                for name in measured} if memory else {"hf": None})
        for ours in names:
            if ours == "hf":
                continue
            rows.append(dict(benchmark=f"greedy generation, batch {batch}",
                             shape=f"d256 L4 V8192 prompt {PROMPT} +{NEW}", ours=ours,
                             peer="hf-gpt2", metric="new tokens/s",
                             ours_value=batch * NEW / timing.median(ours),
                             peer_value=batch * NEW / timing.median("hf"), same_tokens=same[ours],
                             ours_rss=rss.get(ours), peer_rss=rss["hf"],
                             compile_s=first_call[ours] if ours == "aiayn+compile" else None))
    names = ["aiayn", "hf", "aiayn+compile"]
    sides = build_beam(names)
    reference = sides["hf"]()[:, : BEAM_NEW + 1]
    same, first_call = {}, {}
    for name in ("aiayn", "aiayn+compile"):
        began = time.perf_counter()
        same[name] = torch.equal(sides[name](), reference)
        first_call[name] = time.perf_counter() - began
    timing = alternate(sides, rounds=rounds, warmup=1)
    rss = ({name: peak_rss_subprocess("generation.py", name, ["--beam"])
            for name in MEMORY_SIDES} if memory else {"hf": None})
    for ours in ("aiayn", "aiayn+compile"):
        rows.append(dict(benchmark=f"beam search ({BEAMS} beams)",
                         shape=f"marian d256 3+3 V8192 B{BEAM_BATCH} S{SOURCE} +{BEAM_NEW}",
                         ours=ours, peer="hf-marian", metric="new tokens/s",
                         ours_value=BEAM_BATCH * BEAM_NEW / timing.median(ours),
                         peer_value=BEAM_BATCH * BEAM_NEW / timing.median("hf"),
                         same_tokens=same[ours], ours_rss=rss.get(ours), peer_rss=rss["hf"],
                         compile_s=first_call[ours] if ours == "aiayn+compile" else None))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", metavar="SIDE")
    parser.add_argument("--greedy-batch", type=int)
    parser.add_argument("--beam", action="store_true")
    args = parser.parse_args(argv)
    if args.memory:
        build = (lambda side: build_beam([side])[side]) if args.beam else \
            (lambda side: build_greedy([side], args.greedy_batch)[side])
        memory_main(build, args.memory, steps=1)
        return
    for row in run(rounds=args.rounds):
        print(f"{row['benchmark']:<28} {row['ours']:<14} {row['ours_value']:8.0f} vs "
              f"{row['peer_value']:8.0f} "
              f"new tokens/s  ratio {row['ours_value'] / row['peer_value']:.3f}  "
              f"same tokens: {row['same_tokens']}")


if __name__ == "__main__":
    main(sys.argv[1:])
