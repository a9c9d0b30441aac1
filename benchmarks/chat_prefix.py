"""A conversation through ``generate``, every turn with and without a ``PrefixCache``.

What ``aiayn generate RUN_DIR --chat -`` does each turn, without a tokenizer: a scripted chat of
``--turns`` turns on a small decoder (llama-char's blocks at D 512, 6 layers, 8 query / 2 key-value
heads, vocabulary 8192; random weights, float32, CPU, 2 threads). The conversation opens with a
system message of 96 ids; each turn lays out a user message of ``--message`` ids as a chat template
does (<start> user ... <end> <start> assistant) after the history, and the greedy reply of
``--new`` tokens joins the history followed by <end>. Without the prefix cache every turn prefills
the whole history (``--no-prefix-cache``); with it a turn keeps the cache of the turn before and
prefills only what follows the reply. Both sides must give the same replies.

Each side runs the whole conversation, the sides alternating (ours, theirs, theirs, ours, ...)
``--rounds`` times after one warm-up each; per turn the median wall time of each side, and the
median of whole conversations; the ratio is with / without.

    python3 benchmarks/chat_prefix.py --out benchmarks/results/chat_prefix.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import cpu_name, save_results, setup

START, END, USER, ASSISTANT, SYSTEM = 1, 2, 3, 4, 5  # the template's ids
SYSTEM_IDS = 96


def build(scale: float):
    from aiayn import CausalLM, TransformerConfig

    width = max(64, int(512 * scale) // 64 * 64)
    config = TransformerConfig.preset(
        "llama-char", vocab_size=8192, d_model=width, n_heads=8, n_kv_heads=2,
        d_ff=int(width * 8 / 3) // 32 * 32, n_decoder_layers=6, max_length=2048, init_std=0.02)
    torch.manual_seed(0)
    return CausalLM(config).eval()


def script(turns: int, message: int, seed: int = 1) -> tuple[list[int], list[list[int]]]:
    """The system message's ids and each user message's (random ids past the template's)."""
    generator = torch.Generator().manual_seed(seed)

    def ids(length: int) -> list[int]:
        return torch.randint(16, 8192, (length,), generator=generator).tolist()

    return ids(SYSTEM_IDS), [ids(message) for _ in range(turns)]


def converse(model, system: list[int], messages: list[list[int]], new: int, reuse: bool
             ) -> tuple[list[float], list[list[int]], list[int]]:
    """One conversation: per turn its seconds, its reply and the positions it prefilled."""
    from aiayn.decoding.generation import GenerationConfig, generate
    from aiayn.decoding.prefix_cache import PrefixCache

    config = GenerationConfig(max_new_tokens=new, greedy=True)
    cache = PrefixCache() if reuse else None
    history = [START, SYSTEM, *system, END]
    seconds, replies, prefilled = [], [], []
    for message in messages:
        prompt = history + [START, USER, *message, END, START, ASSISTANT]
        began = time.perf_counter()
        reply = generate(model, prompt, config, prefix_cache=cache).tokens[0]
        seconds.append(time.perf_counter() - began)
        replies.append(reply)
        prefilled.append(cache.prefilled if reuse else len(prompt))
        history = prompt + reply + [END]
    return seconds, replies, prefilled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--message", type=int, default=64, help="ids per user message")
    parser.add_argument("--new", type=int, default=48, help="new tokens per reply")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrink the model's width (tests); 1: D 512")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    setup()
    model = build(args.scale)
    system, messages = script(args.turns, args.message)
    sides = {"prefix_cache": True, "full_prefill": False}
    times: dict[str, list[list[float]]] = {name: [] for name in sides}
    replies, prefilled = {}, {}
    with torch.inference_mode():
        for name, reuse in sides.items():  # warm-up
            _, replies[name], prefilled[name] = converse(model, system, messages, args.new, reuse)
        if replies["prefix_cache"] != replies["full_prefill"]:
            sys.exit("the replies differ with and without the prefix cache")
        for round_index in range(args.rounds):
            order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
            for name in order:
                times[name].append(converse(model, system, messages, args.new, sides[name])[0])
    turns = []
    for index in range(args.turns):
        row = {name: statistics.median(run[index] for run in times[name]) for name in sides}
        row.update(turn=index + 1, prompt=prefilled["full_prefill"][index],
                   prefilled=prefilled["prefix_cache"][index],
                   ratio=row["prefix_cache"] / row["full_prefill"])
        turns.append(row)
        print(f"turn {index + 1}: prompt {row['prompt']:4d} ids, prefilled "
              f"{row['prefilled']:4d}: {row['prefix_cache']:.3f} s with the prefix cache, "
              f"{row['full_prefill']:.3f} s without ({row['ratio']:.2f}x)")
    whole = {name: statistics.median(sum(run) for run in times[name]) for name in sides}
    ratio = whole["prefix_cache"] / whole["full_prefill"]
    print(f"conversation of {args.turns} turns: {whole['prefix_cache']:.2f} s with the prefix "
          f"cache, {whole['full_prefill']:.2f} s without: {ratio:.2f}x the time "
          f"({1 - ratio:.0%} less)")
    command = "python3 benchmarks/" + " ".join(sys.argv[0].split("/")[-1:] + sys.argv[1:])
    print(command)
    if args.out:
        parameters = sum(p.numel() for p in model.parameters())
        save_results(Path(args.out), dict(
            command=command, cpu=cpu_name(), threads=torch.get_num_threads(),
            torch=torch.__version__, parameters=parameters, new_tokens=args.new,
            message=args.message, rounds=args.rounds, turns=turns,
            conversation=dict(whole, ratio=ratio)))


if __name__ == "__main__":
    main()
