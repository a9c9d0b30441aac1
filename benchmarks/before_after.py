"""Two checkouts of aiayn side by side on the jobs users run: a change's before and after.

    python3 benchmarks/before_after.py --before /path/to/old/checkout/src [--rounds 5] [--jobs ...]

Each job runs in a fresh interpreter per measurement (as a user's process would), with PYTHONPATH
pointing at one checkout's ``src``; the sides alternate (before, after, after+compile, before, ...)
for ``--rounds`` rounds, and the table gives each side's median seconds per call and the ratio
before / side (> 1: the side is faster). ``after+compile`` runs the decoding jobs through an
``aiayn.fast`` engine (compiled steps, compile time excluded by the warm-up). Models are built from
configs with a fixed seed, so both sides compute the same thing; only APIs both checkouts share are
used.

Jobs (shapes of benchmarks/run_all.py):
- greedy1 / greedy8: ``generate`` of 256 tokens after a prompt of 16, GPT-2-style d256 L4 V8192;
- beam: ``beam_search`` (4 beams) of 4 sources of 32 tokens, encoder-decoder d256 3+3 V8192;
- encoder / encoder-padded: an inference forward, all-MiniLM-L6 shapes (d384 L6), batch 32 x 128;
- lm-train: a training step (loss, backward, fused Adam) of the LM above at batch 8 x 256;
- seq2seq-train: a training step of the encoder-decoder above at batch 16, 64 + 64 tokens;
- window-long: ``generate`` of 512 tokens after a prompt of 4,096, a Mistral-style decoder (RoPE,
  RMSNorm, SwiGLU, 8 query / 2 key-value heads) d256 L4 V8192 with a sliding window of 256 on
  every layer (not in the default set: its checkouts need ``sliding_window``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

JOBS = ("greedy1", "greedy8", "beam", "encoder", "encoder-padded", "lm-train", "seq2seq-train")
ON_REQUEST = ("window-long",)
DECODING = ("greedy1", "greedy8", "beam")
HERE = Path(__file__).resolve()


def _config(job: str):
    from aiayn import TransformerConfig

    if job.startswith("greedy") or job == "lm-train":
        return TransformerConfig(vocab_size=8192, d_model=256, n_heads=4, d_ff=1024,
                                 n_encoder_layers=0, n_decoder_layers=4, max_length=512,
                                 dropout=0.0, activation="gelu_tanh", norm_first=True,
                                 positions="learned", scale_embeddings=False, init_std=0.02)
    if job == "window-long":
        return TransformerConfig.preset("llama-char", vocab_size=8192, d_model=256, n_heads=8,
                                        n_kv_heads=2, d_ff=768, n_decoder_layers=4,
                                        max_length=8192, sliding_window=256)
    if job in ("beam", "seq2seq-train"):
        return TransformerConfig(vocab_size=8192, d_model=256, n_heads=4, d_ff=1024,
                                 n_encoder_layers=3, n_decoder_layers=3, max_length=512,
                                 dropout=0.0)
    return TransformerConfig(vocab_size=30522, d_model=384, n_heads=12, d_ff=1536,
                             n_encoder_layers=6, n_decoder_layers=0, max_length=512, dropout=0.0,
                             activation="gelu", positions="learned", scale_embeddings=False,
                             embedding_norm=True, type_vocab_size=2, layer_norm_eps=1e-12)


def _generate():
    try:
        from aiayn.decoding.generation import generate
    except ImportError:  # checkouts before generation.py
        from aiayn.decoding.sampling import generate
    return generate


def _job(job: str, compiled: bool):
    """A zero-argument callable that runs the job once."""
    import torch

    torch.manual_seed(0)
    config = _config(job)
    if job.startswith("greedy"):
        from aiayn import CausalLM

        model = CausalLM(config).eval()
        prompt = torch.randint(3, 8192, (int(job[len("greedy"):]), 16))
        if compiled:
            from aiayn.fast import InferenceOptions, prepare_for_inference

            engine = prepare_for_inference(model, InferenceOptions(compile=True))
            return lambda: engine.generate(prompt, max_new_tokens=256, greedy=True)
        generate = _generate()
        return lambda: generate(model, prompt, max_new_tokens=256, greedy=True)
    if job == "window-long":
        from aiayn import CausalLM

        model = CausalLM(config).eval()
        prompt = torch.randint(3, 8192, (1, 4096))
        generate = _generate()
        return lambda: generate(model, prompt, max_new_tokens=512, greedy=True)
    if job == "beam":
        from aiayn import Transformer
        from aiayn.decoding.beam import beam_search

        model = Transformer(config).eval()
        source = torch.randint(3, 8192, (4, 32))
        mask = torch.ones_like(source, dtype=torch.bool)
        if compiled:
            from aiayn.fast import InferenceOptions, prepare_for_inference

            engine = prepare_for_inference(model, InferenceOptions(compile=True))
            return lambda: engine.beam_search(source, mask, beam_size=4, max_extra=0)
        return lambda: beam_search(model, source, mask, beam_size=4, max_extra=0)
    if job.startswith("encoder"):
        from aiayn import TransformerEncoder

        model = TransformerEncoder(config).eval()
        ids = torch.randint(3, 30522, (32, 128))
        mask = None
        if job == "encoder-padded":
            lengths = torch.randint(16, 129, (32,))
            mask = torch.arange(128)[None, :] < lengths[:, None]
            ids = ids.masked_fill(~mask, 0)

        def forward():
            with torch.inference_mode():
                return model(ids, padding_mask=mask)
        return forward
    if job == "lm-train":
        from aiayn import CausalLM
        from aiayn.tasks.lm import token_loss

        model = CausalLM(config).train()
        ids = torch.randint(0, 8192, (8, 257))

        def loss():
            return token_loss(model, ids[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
    else:
        from aiayn import Transformer
        from aiayn.tasks.translation import translation_loss

        model = Transformer(config).train()
        source, target = torch.randint(3, 8192, (16, 64)), torch.randint(3, 8192, (16, 65))

        def loss():
            return translation_loss(model, source, target[:, :-1], target[:, 1:],
                                    smoothing=0.1) / target[:, 1:].numel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), fused=True)

    def step():
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def worker(job: str, compiled: bool, reps: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("AIAYN_BENCH_THREADS", "2")))
    run = _job(job, compiled)
    began = time.perf_counter()
    run()  # warm-up: compiles the compiled side's steps
    first = time.perf_counter() - began
    run()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    print(json.dumps({"seconds": statistics.median(times), "first": first}))


def measure(side: str, source: str, job: str, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": source}
    command = [sys.executable, str(HERE), "--worker", job, "--reps", str(reps)]
    if side == "after+compile":
        command.append("--compiled")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the old checkout's src directory")
    parser.add_argument("--after", default=str(HERE.parent.parent / "src"))
    parser.add_argument("--jobs", nargs="+", choices=JOBS + ON_REQUEST, default=list(JOBS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="timed calls per measurement")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--worker", choices=JOBS + ON_REQUEST, help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.compiled, args.reps)
        return
    if not args.before:
        parser.error("--before is required")
    results = {}
    for job in args.jobs:
        sides = {"before": args.before, "after": args.after}
        if job in DECODING:
            sides["after+compile"] = args.after
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, source in sides.items():
                seconds[side].append(measure(side, source, job, args.reps)["seconds"])
        medians = {side: statistics.median(values) for side, values in seconds.items()}
        results[job] = {"median_s": medians, "runs_s": seconds,
                        "before_over": {side: medians["before"] / medians[side] for side in sides}}
        print(f"{job:<15} " + "  ".join(f"{side} {medians[side] * 1000:8.1f} ms "
                                          f"({medians['before'] / medians[side]:.3f}x)"
                                          for side in sides), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": "python3 benchmarks/before_after.py "
                                        + " ".join(argv), "results": results}, indent=1) + "\n",
                            encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
