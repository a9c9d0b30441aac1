"""aiayn against its peers on a GPU: training, decoding, encoding, each peer in its own best set-up.

    python3 benchmarks/gpu.py [--only ROW ...]      # CUDA device 0; writes benchmarks/results/gpu.json
    python3 benchmarks/gpu.py --device cpu --tiny  # small shapes on the CPU: checks the program runs
    python3 benchmarks/gpu.py --only greedy1 beam --profile  # also what one call of each side runs

Rows (each side in one process, alternating after a warm-up, medians, a device synchronisation
after every call; the first call, which compiles where a side compiles, is timed apart):

- ``lm_train``: GPT-2 small as nanoGPT's ``bench.py`` trains it (benchmarks/nanogpt.py: 12 layers,
  12 heads, d 768, vocabulary 50304, context 1024, batch 12, no biases, dropout 0, bf16 autocast,
  TF32, fused AdamW): nanoGPT eager and ``torch.compile(model)`` against aiayn's own training step
  (``aiayn.tasks.lm.token_loss``, what ``aiayn train lm`` runs) eager and compiled the way
  ``aiayn train --compile`` compiles it (the loss function, model and loss in one graph). aiayn's
  model holds nanoGPT's weights. Tokens/s and MFU with nanoGPT's FLOP count against the bf16 GEMM
  peak measured at the start of the run.
- ``seq2seq_train``: the paper's base model (d 512, 8 heads, d_ff 2048, 6 + 6 layers, vocabulary
  32000, source and target 128, batch 32) under bf16 autocast: aiayn (``translation_loss``) against
  ``torch.nn.Transformer`` and HF ``MarianMTModel`` of the same shapes holding the same weights.
- ``greedy1`` / ``greedy8``: GPT-2 small (HF's vocabulary, 50257) with bf16 weights, prompt 16, 256
  new tokens: HF ``generate`` against aiayn's plain ``generate`` and an ``aiayn.fast`` engine
  (``aiayn+graphs``: CUDA graphs; ``aiayn+engine``: compiled steps in CUDA graphs).
- ``sample8``: the same, top-k 50 sampling at batch 8.
- ``beam``: beam search, 4 beams, 8 sources of 32 tokens, 32 new tokens, the base model above with
  bf16 weights: HF ``generate(num_beams=4)`` against aiayn's plain ``beam_search`` and an engine's
  (``aiayn+graphs``: the graphed beam search of ``aiayn.fast.graphed_beam``; ``aiayn+engine``: the
  same with its step compiled).
- ``greedy_mt``: the same sources and model, greedy (``num_beams=1``): aiayn's plain
  ``greedy_search`` and an engine's (``aiayn+graphs``: on CUDA, the graphed search with one beam)
  against HF ``generate``.
- ``encoder``: BERT-base inference (d 768, 12 layers, 32 x 128) with bf16 weights.

Memory of each side on CUDA: the peak of ``torch.cuda.max_memory_allocated`` during one call above
what was allocated before it (activations, logits, workspaces: what differs between sides holding
the same weights and optimizer state), after the warm-up.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR, alternate, mib, save_results  # noqa: E402
from nanogpt import GPT, NanoConfig, aiayn_from_nanogpt, bench_optimizer  # noqa: E402
from peers import aiayn_from_hf, hf_bert, hf_gpt2, hf_marian  # noqa: E402

ROWS = ("lm_train", "greedy1", "greedy8", "sample8", "beam", "greedy_mt", "seq2seq_train",
        "encoder")


@dataclass(frozen=True)
class Shapes:
    d_model: int = 768
    layers: int = 12
    heads: int = 12
    vocab: int = 50304  # nanoGPT's padded GPT-2 vocabulary (training)
    gpt2_vocab: int = 50257  # HF GPT-2's (decoding)
    length: int = 1024
    batch: int = 12
    prompt: int = 16
    new_tokens: int = 256
    base_d_model: int = 512
    base_heads: int = 8
    base_layers: int = 6
    base_vocab: int = 32000
    base_length: int = 128
    base_batch: int = 32
    beam_sources: int = 8
    beam_length: int = 32
    encoder_length: int = 128
    encoder_batch: int = 32
    bert_vocab: int = 30522


GPT2_SMALL = Shapes()
TINY = Shapes(d_model=64, layers=2, heads=2, vocab=512, gpt2_vocab=500, length=64, batch=2,
              new_tokens=16, base_d_model=64, base_heads=2, base_layers=2, base_vocab=512,
              base_length=16, base_batch=4, beam_sources=2, beam_length=8, encoder_length=32,
              encoder_batch=4, bert_vocab=512)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(call, device: torch.device):
    """``call`` followed by a device synchronisation, so host timers see the GPU's work."""

    def run():
        result = call()
        synchronize(device)
        return result

    return run


def gemm_peak_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """Best-of-``repeats`` throughput of an n^3 matmul in ``dtype``: the MFU denominator."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12


def autocast(device: torch.device, step):
    def run():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return step()

    return run


def train_step(model, loss_of, optimizer):
    def step():
        loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


# --- sides -----------------------------------------------------------------------------------------
def build_lm(which: list[str], shapes: Shapes, device: torch.device) -> dict:
    from aiayn.tasks.lm import token_loss

    torch.manual_seed(0)
    config = NanoConfig(block_size=shapes.length, vocab_size=shapes.vocab, n_layer=shapes.layers,
                        n_head=shapes.heads, n_embd=shapes.d_model)
    ids = torch.randint(0, shapes.vocab, (shapes.batch, shapes.length + 1), device=device)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    reference = GPT(config)
    sides = {}
    for name in which:
        if name.startswith("nanogpt"):
            model = GPT(config).to(device)
            model.load_state_dict(reference.state_dict())
            optimizer = bench_optimizer(model, device.type)
            forward = torch.compile(model) if name == "nanogpt+compile" else model
            sides[name] = train_step(model, lambda f=forward: f(inputs, targets)[1], optimizer)
        else:
            model = aiayn_from_nanogpt(reference).to(device).train()
            optimizer = bench_optimizer(model, device.type)
            loss = torch.compile(token_loss) if name == "aiayn+compile" else token_loss
            sides[name] = train_step(
                model, lambda m=model, f=loss: f(m, inputs, targets) / targets.numel(), optimizer)
        sides[name] = autocast(device, sides[name])
    return sides


def build_seq2seq(which: list[str], shapes: Shapes, device: torch.device) -> dict:
    from seq2seq_train import TorchSeq2Seq, aiayn_from_torch

    from aiayn.tasks.translation import translation_loss

    torch.manual_seed(0)
    size = dict(d_model=shapes.base_d_model, heads=shapes.base_heads, layers=shapes.base_layers,
                d_ff=4 * shapes.base_d_model, vocab=shapes.base_vocab)
    src = torch.randint(3, shapes.base_vocab, (shapes.base_batch, shapes.base_length),
                        device=device)
    tgt = torch.randint(3, shapes.base_vocab, (shapes.base_batch, shapes.base_length + 1),
                        device=device)
    tgt_in, tgt_out = tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()
    peers: dict = {}
    sides = {}

    def mean_ce(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))

    def ours(model):
        return lambda: translation_loss(model, src, tgt_in, tgt_out) / tgt_out.numel()

    for name in which:
        fused = dict(lr=1e-4, fused=device.type == "cuda")
        if name in ("torch.nn", "aiayn<-torch.nn"):
            peer = peers.setdefault("torch", TorchSeq2Seq(**size).train())
            model = (peer if name == "torch.nn" else aiayn_from_torch(peer).train()).to(device)
            loss = (lambda m=model: mean_ce(m(src, tgt_in))) if name == "torch.nn" else ours(model)
        else:
            peer = peers.setdefault("marian", hf_marian(
                d_model=size["d_model"], layers=size["layers"], heads=size["heads"],
                d_ff=size["d_ff"], vocab=size["vocab"], positions=512).train())
            model = (peer if name == "marian" else aiayn_from_hf(peer).train()).to(device)
            loss = ((lambda m=model: mean_ce(m(input_ids=src, decoder_input_ids=tgt_in).logits))
                    if name == "marian" else ours(model))
        sides[name] = autocast(device, train_step(model, loss,
                                                  torch.optim.AdamW(model.parameters(), **fused)))
    return sides


def _engine(model, *, compile: bool):
    from aiayn.fast import InferenceOptions, prepare_for_inference

    return prepare_for_inference(model, InferenceOptions(compile=compile))


def build_decoding(row: str, which: list[str], shapes: Shapes, device: torch.device) -> dict:
    """Greedy or sampled generation with bf16 weights; sides return the new tokens (B, N)."""
    from aiayn.decoding.generation import generate

    torch.manual_seed(0)
    batch = int(row[-1])
    sample = row.startswith("sample")
    hf = hf_gpt2(d_model=shapes.d_model, layers=shapes.layers, heads=shapes.heads,
                 vocab=shapes.gpt2_vocab, positions=shapes.prompt + shapes.new_tokens).eval()
    prompt = torch.randint(1, shapes.gpt2_vocab, (batch, shapes.prompt), device=device)
    options = dict(top_k=50, seed=0) if sample else dict(greedy=True)
    sides = {}
    for name in sorted(which, key=lambda name: name == "hf"):  # hf last: it becomes bf16
        if name == "hf":
            hf = hf.to(device, torch.bfloat16)
            sides[name] = lambda: hf.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=sample,
                top_k=50 if sample else None, num_beams=1, max_new_tokens=shapes.new_tokens,
                min_new_tokens=shapes.new_tokens, pad_token_id=0,
                eos_token_id=None)[:, shapes.prompt:]
            continue
        model = aiayn_from_hf(hf).eval().to(device, torch.bfloat16)
        if name == "aiayn":
            call = lambda m=model: generate(m, prompt, max_new_tokens=shapes.new_tokens,
                                            **options)
        else:
            engine = _engine(model, compile=name == "aiayn+engine")
            call = lambda e=engine: e.generate(prompt, max_new_tokens=shapes.new_tokens,
                                               **options)
        sides[name] = lambda call=call: torch.tensor(call().tokens)
    return sides


def build_beam(which: list[str], shapes: Shapes, device: torch.device, beams: int = 4) -> dict:
    """The ``beam`` row's sides, or with ``beams`` 1 the ``greedy_mt`` row's."""
    from aiayn.decoding.beam import beam_search
    from aiayn.decoding.greedy import greedy_search

    torch.manual_seed(0)
    hf = hf_marian(d_model=shapes.base_d_model, layers=shapes.base_layers,
                   heads=shapes.base_heads, d_ff=4 * shapes.base_d_model,
                   vocab=shapes.base_vocab, positions=512).eval()
    src = torch.randint(3, shapes.base_vocab, (shapes.beam_sources, shapes.beam_length),
                        device=device)
    mask = torch.ones_like(src, dtype=torch.bool)
    sides = {}
    for name in sorted(which, key=lambda name: name == "hf"):  # hf last: it becomes bf16
        if name == "hf":
            hf = hf.to(device, torch.bfloat16)
            sides[name] = lambda: hf.generate(
                src, attention_mask=mask.long(), num_beams=beams, do_sample=False,
                max_new_tokens=shapes.beam_length, min_new_tokens=shapes.beam_length,
                eos_token_id=None, forced_eos_token_id=None, length_penalty=1.0,
                early_stopping=False, bad_words_ids=None, pad_token_id=0)
            continue
        model = aiayn_from_hf(hf).eval().to(device, torch.bfloat16)
        if name == "aiayn":  # the plain search, eager steps
            greedy, beam = partial(greedy_search, model), partial(beam_search, model)
        else:  # on CUDA: graphed steps
            engine = _engine(model, compile=name == "aiayn+engine")
            greedy, beam = engine.greedy_search, engine.beam_search
        if beams == 1:
            sides[name] = lambda search=greedy: search(src, mask, max_extra=0)
        else:
            sides[name] = lambda search=beam: search(src, mask, beam_size=beams, alpha=0.0,
                                                     max_extra=0)
    return sides


def build_encoder(which: list[str], shapes: Shapes, device: torch.device) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(1, shapes.bert_vocab, (shapes.encoder_batch, shapes.encoder_length),
                        device=device)
    hf = hf_bert(d_model=shapes.d_model, layers=shapes.layers, heads=shapes.heads,
                 d_ff=4 * shapes.d_model, vocab=shapes.bert_vocab, positions=512).eval()
    sides = {}
    for name in sorted(which, key=lambda name: name == "hf"):  # hf last: it becomes bf16
        if name == "aiayn":
            model = aiayn_from_hf(hf).eval().to(device, torch.bfloat16)
            sides[name] = lambda m=model: torch.inference_mode()(m)(ids)
        else:
            hf = hf.to(device, torch.bfloat16)
            sides[name] = lambda: torch.inference_mode()(hf)(input_ids=ids).last_hidden_state
    return sides


PAIRS = {"lm_train": [("aiayn", "nanogpt"), ("aiayn+compile", "nanogpt+compile"),
                      ("aiayn+compile", "nanogpt")],
         "seq2seq_train": [("aiayn<-torch.nn", "torch.nn"), ("aiayn<-marian", "marian")],
         "greedy1": [("aiayn", "hf"), ("aiayn+graphs", "hf"), ("aiayn+engine", "hf")],
         "greedy8": [("aiayn", "hf"), ("aiayn+engine", "hf")],
         "sample8": [("aiayn+engine", "hf")],
         "beam": [("aiayn", "hf"), ("aiayn+graphs", "hf"), ("aiayn+engine", "hf")],
         "greedy_mt": [("aiayn", "hf"), ("aiayn+graphs", "hf")],
         "encoder": [("aiayn", "hf")]}


def build(row: str, which: list[str], shapes: Shapes, device: torch.device) -> dict:
    if row == "lm_train":
        return build_lm(which, shapes, device)
    if row == "seq2seq_train":
        return build_seq2seq(which, shapes, device)
    if row in ("greedy1", "greedy8", "sample8"):
        return build_decoding(row, which, shapes, device)
    if row == "beam":
        return build_beam(which, shapes, device)
    if row == "greedy_mt":
        return build_beam(which, shapes, device, beams=1)
    return build_encoder(which, shapes, device)


# --- memory --------------------------------------------------------------------------------------
def peak_above_resident(call, device: torch.device) -> int | None:
    """Bytes a call allocates at its peak beyond what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# --- profiles -------------------------------------------------------------------------------------
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "cudaMemcpyAsync")


def profile_call(call, device: torch.device, top: int = 15) -> dict:
    """What one call runs, from ``torch.profiler``: its wall time, the device's busy time (the sum
    of the kernels' times: far below the wall time means the host, not the device, sets the pace),
    kernel launches, host-device copies and syncs, and the ``top`` kernels by total time (on the
    CPU: operators by self time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        synchronize(device)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        time_of = lambda e: e.self_device_time_total  # noqa: E731 - microseconds
    else:
        kernels = [e for e in events if e.self_cpu_time_total > 0]
        time_of = lambda e: e.self_cpu_time_total  # noqa: E731
    kernels.sort(key=time_of, reverse=True)
    host = {e.key: e.count for e in events if e.key in SYNC_EVENTS}
    return dict(wall_ms=1000 * wall, busy_ms=sum(time_of(e) for e in kernels) / 1000,
                launches=sum(e.count for e in kernels), host_calls=host,
                top=[dict(name=e.key[:120], count=e.count, ms=time_of(e) / 1000)
                     for e in kernels[:top]])


def safe_profile(call, device: torch.device) -> dict:
    """``profile_call``, or the error it raised: a profile never costs a row its measurements."""
    try:
        return profile_call(call, device)
    except Exception:  # noqa: BLE001 - recorded, and the row keeps its timings
        return dict(error=traceback.format_exc()[-2000:])


# --- the rows -------------------------------------------------------------------------------------
def units(row: str, shapes: Shapes) -> tuple[int, str, str]:
    """Units a call processes, their name, and the row's shape label."""
    if row == "lm_train":
        return (shapes.batch * shapes.length, "tokens/s",
                f"d{shapes.d_model} L{shapes.layers} T{shapes.length} B{shapes.batch} "
                f"V{shapes.vocab}")
    if row == "seq2seq_train":
        return (shapes.base_batch * shapes.base_length, "target tokens/s",
                f"d{shapes.base_d_model} {shapes.base_layers}+{shapes.base_layers} "
                f"S=T{shapes.base_length} B{shapes.base_batch} V{shapes.base_vocab}")
    if row in ("beam", "greedy_mt"):
        return (shapes.beam_sources * shapes.beam_length, "new tokens/s",
                f"d{shapes.base_d_model} {shapes.base_layers}+{shapes.base_layers} "
                f"{shapes.beam_sources} x S{shapes.beam_length} +{shapes.beam_length}")
    if row == "encoder":
        return (shapes.encoder_batch * shapes.encoder_length, "tokens/s",
                f"d{shapes.d_model} L{shapes.layers} T{shapes.encoder_length} "
                f"B{shapes.encoder_batch}")
    batch = int(row[-1])
    return batch * shapes.new_tokens, "new tokens/s", \
        f"d{shapes.d_model} L{shapes.layers} B{batch} +{shapes.new_tokens}"


def run_row(row: str, args: argparse.Namespace, shapes: Shapes, device: torch.device,
            peak_tflops: float) -> list[dict]:
    pairs = PAIRS[row]
    names = list(dict.fromkeys(name for pair in pairs for name in pair))
    sides = build(row, names, shapes, device)
    first_call, outputs = {}, {}
    for name in names:
        start = time.perf_counter()
        outputs[name] = synced(sides[name], device)()
        first_call[name] = time.perf_counter() - start
        print(f"  {row} {name}: first call {first_call[name]:.1f} s", flush=True)
    memory = {name: peak_above_resident(sides[name], device) for name in names}
    timing = alternate({name: synced(sides[name], device) for name in names},
                       rounds=args.rounds, warmup=1, budget_s=args.row_budget_s)
    count, metric, shape = units(row, shapes)
    flops = None
    if row == "lm_train":
        config = NanoConfig(block_size=shapes.length, vocab_size=shapes.vocab,
                            n_layer=shapes.layers, n_head=shapes.heads, n_embd=shapes.d_model)
        flops = GPT(config).flops_per_token() * count
    entries = []
    for ours, peer in pairs:
        seconds_ours, seconds_peer = timing.median(ours), timing.median(peer)
        entry = dict(benchmark=row, shape=shape, ours=ours, peer=peer, metric=metric,
                     ours_value=count / seconds_ours, peer_value=count / seconds_peer,
                     ratio=seconds_peer / seconds_ours, ours_ms=1000 * seconds_ours,
                     peer_ms=1000 * seconds_peer, ours_memory=memory.get(ours),
                     peer_memory=memory.get(peer), ours_first_call_s=first_call[ours],
                     peer_first_call_s=first_call[peer])
        if flops is not None:
            entry.update(ours_mfu=flops / seconds_ours / 1e12 / peak_tflops,
                         peer_mfu=flops / seconds_peer / 1e12 / peak_tflops,
                         ours_first_loss=outputs[ours].item(),
                         peer_first_loss=outputs[peer].item())
        if row in ("greedy1", "greedy8"):
            entry["same_tokens"] = (outputs[ours].cpu() == outputs[peer].cpu()).float().mean().item()
        entries.append(entry)
    if args.profile:
        profiles = {name: safe_profile(sides[name], device) for name in names}
        for entry in entries:
            entry.update(ours_profile=profiles[entry["ours"]], peer_profile=profiles[entry["peer"]])
    return entries


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def print_row(row: dict) -> None:
    mfu = (f"  MFU {100 * row['ours_mfu']:.1f}% / {100 * row['peer_mfu']:.1f}%"
           if "ours_mfu" in row else "")
    same = f"  same tokens {100 * row['same_tokens']:.0f}%" if "same_tokens" in row else ""
    print(f"{row['benchmark']:<14} {row['ours']:<16} vs {row['peer']:<16} "
          f"{row['ours_value']:10.0f} / {row['peer_value']:10.0f} {row['metric']}  "
          f"({row['ours_ms']:.2f} / {row['peer_ms']:.2f} ms)  ratio {row['ratio']:.3f}{mfu}  "
          f"step peak MiB {mib(row['ours_memory'])} / {mib(row['peer_memory'])}{same}", flush=True)
    for side in ("ours", "peer"):
        profile = row.get(f"{side}_profile")
        if profile and "error" in profile:
            print(f"  {row[side]}: profile failed: {profile['error'].splitlines()[-1]}", flush=True)
        elif profile:
            print(f"  {row[side]}: wall {profile['wall_ms']:.1f} ms, busy {profile['busy_ms']:.1f} "
                  f"ms, {profile['launches']} launches, {profile['host_calls']}; top: "
                  + ", ".join(f"{k['name'][:40]} x{k['count']} {k['ms']:.1f} ms"
                              for k in profile["top"][:5]), flush=True)


def transformers_version() -> str | None:
    """The installed transformers' version (the HF peer's library), None without it."""
    try:
        from importlib.metadata import version

        return version("transformers")
    except ImportError:  # PackageNotFoundError: not installed
        return None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (a check that it runs)")
    parser.add_argument("--only", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--row-budget-s", type=float, default=None,
                        help="stop a row's timing rounds (after 3) once this many seconds are spent")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one call of each side (torch.profiler: device busy "
                             "time, launches, syncs, top kernels) into the results")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "results" / "gpu.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu (with --tiny) to check the program")
    torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's bench.py sets both
    torch.backends.cudnn.allow_tf32 = True
    shapes = TINY if args.tiny else GPT2_SMALL
    began = time.perf_counter()
    peak = gemm_peak_tflops(device, torch.bfloat16, 512 if args.tiny else 8192)
    print(f"{describe(device)}: bf16 GEMM peak {peak:.1f} TFLOP/s (8192^3, best of 10); "
          f"torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    failed: dict[str, str] = {}

    def save(finished: bool) -> None:  # after every row: a run cut short keeps what it measured
        save_results(args.out, dict(
            command="python3 benchmarks/gpu.py " + " ".join(argv), device=describe(device),
            torch=torch.__version__, transformers=transformers_version(),
            bf16_gemm_peak_tflops=peak, shapes=asdict(shapes),
            seconds=time.perf_counter() - began, finished=finished, rows=rows,
            failed_rows=failed))

    for row in args.only:
        try:
            entries = run_row(row, args, shapes, device, peak)
        except Exception:  # one broken row must not cost the others a rarely lent GPU's run
            failed[row] = traceback.format_exc()
            print(f"row {row} failed:\n{failed[row]}", flush=True)
            save(finished=False)
            continue
        for entry in entries:
            rows.append(entry)
            print_row(entry)
        save(finished=False)
    save(finished=True)
    print(f"{time.perf_counter() - began:.0f} s; wrote {args.out}")
    if failed:
        sys.exit(f"rows that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main(sys.argv[1:])
