"""``PrefixCache``: one ``generate`` call's KV cache carried into the next.

The reference is ``generate`` without it (a fresh cache and a full prefill per call), which
tests/test_sampling.py checks against full forwards: with the prefix kept the tokens are the same,
greedy and seeded sampling, over turns whose prompts share prefixes of every kind with the cached
ids; the logits and cached keys of a kept-prefix prefill are those of a full forward; each case
that must prefill whole does, and says why; the ``--chat -`` command gives the same replies with
and without it."""

from __future__ import annotations

import argparse
import io
import sys

import pytest
import torch

from aiayn import CausalLM, TransformerConfig
from aiayn.decoding.generation import GenerationConfig, Steps, decode_step, generate
from aiayn.decoding.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = TransformerConfig.preset("llama-char", vocab_size=50, d_model=64, n_heads=8, n_kv_heads=2,
                                 d_ff=96, n_decoder_layers=2, max_length=96, init_std=0.2)
# Dr = 6 of Dh = 8, LongRoPE's original context 16 of max_length 48 (as tests/test_modern_decoder)
LONGROPE = {"rope_type": "longrope", "factor": 3.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.5, 2.5], "long_factor": [1.25, 4.0, 9.0]}
GREEDY = GenerationConfig(max_new_tokens=8, greedy=True)


def lm(seed: int = 0, **changes) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(LLAMA.replace(**changes)).eval()


class Recording(Steps):
    """Plain steps that record each prefill: the cache, its first column and the logits."""

    def __init__(self):
        super().__init__()
        self.prefills: list[tuple[object, int, torch.Tensor]] = []

    def prefill(self, model, cache, sequence, real, start, end, padded):
        logits, positions = super().prefill(model, cache, sequence, real, start, end, padded)
        self.prefills.append((cache, start, logits))
        return logits, positions


def turn(model, prompt, cache: PrefixCache, config: GenerationConfig = GREEDY, **kwargs):
    """One call with the prefix cache and the same call without it: (tokens, reference)."""
    got = generate(model, prompt, config, prefix_cache=cache, **kwargs).tokens
    want = generate(model, prompt, config, **{k: v for k, v in kwargs.items()
                                              if k != "generator"}).tokens
    return got, want


def held_ids(prompt: list[int], tokens: list[int]) -> list[int]:
    """The ids a cache holds after a call that ran to length: the last new token is not fed."""
    return prompt + tokens[:-1]


def test_turns_sharing_prefixes_of_every_length_give_the_tokens_of_full_prefills():
    model = lm()
    cache = PrefixCache()
    first = [5, 6, 7, 8, 9, 10, 11]
    got, want = turn(model, first, cache)
    assert got == want
    assert (cache.kept, cache.prefilled, cache.fallback) == (0, 7, "nothing kept yet")
    held = held_ids(first, got[0])
    assert cache.held == len(held) == 14
    # the cached ids, then a new message: every cached position kept
    second = held + [3, 4, 20, 21]
    got, want = turn(model, second, cache)
    assert got == want and (cache.kept, cache.prefilled, cache.fallback) == (14, 4, None)
    held = held_ids(second, got[0])
    # shares 9 ids, then differs (a reply the template re-encodes otherwise)
    third = held[:9] + [40, 41, 42] + held[9:15]
    assert third[9] != held[9]
    got, want = turn(model, third, cache)
    assert got == want and (cache.kept, cache.prefilled) == (9, len(third) - 9)
    held = held_ids(third, got[0])
    # a strict prefix of the cached ids: all but its last id kept (its logits pick a token)
    fourth = held[:12]
    got, want = turn(model, fourth, cache)
    assert got == want and (cache.kept, cache.prefilled) == (11, 1)
    held = held_ids(fourth, got[0])
    # exactly the cached ids
    got, want = turn(model, held, cache)
    assert got == want and (cache.kept, cache.prefilled) == (len(held) - 1, 1)
    # nothing shared: the first id differs
    fifth = [held[0] + 1] + held[1:]
    got, want = turn(model, fifth, cache)
    assert got == want
    assert (cache.kept, cache.prefilled) == (0, len(fifth))
    assert cache.fallback == "the prompt shares no prefix with the cached ids"
    # reply lengths: a stop id ends a reply early, and the next turn keeps what was fed
    stop = generate(model, fifth + [7], GREEDY).tokens[0][3]
    config = GREEDY.replace(stop_ids=(stop,))
    got, want = turn(model, fifth + [7], cache, config)
    assert got == want and len(got[0]) < 8


def test_a_kept_prefix_prefill_gives_the_logits_and_keys_of_a_full_forward():
    model = lm(1)
    cache, steps = PrefixCache(), Recording()
    ids = torch.randint(3, 50, (30,)).tolist()
    generate(model, ids[:10], GREEDY, prefix_cache=cache, steps=steps)
    generate(model, ids[:10] + [3, 4] + ids[12:], GREEDY, prefix_cache=cache, steps=steps)
    assert cache.kept == 10
    kept_cache, start, logits = steps.prefills[-1]
    assert start == 10
    prompt = torch.tensor([ids[:10] + [3, 4] + ids[12:]])  # (1, 30)
    fresh = model.new_cache(1, 30)
    with torch.no_grad():
        full = model(prompt, cache=fresh)[:, -1]  # (1, V)
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    for kept, whole in zip(kept_cache.self_attention, fresh.self_attention):
        torch.testing.assert_close(kept.keys[:, :, :30], whole.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kept.values[:, :, :30], whole.values, rtol=1e-5, atol=1e-5)


def test_the_cache_grows_within_the_context_and_keeps_its_positions():
    model = lm()
    cache = PrefixCache()
    prompt = [5, 6, 7, 8, 9]
    sizes = []
    for index in range(8):
        got, want = turn(model, prompt, cache)
        assert got == want
        assert cache.kept == (0 if index == 0 else len(prompt) - 3)
        sizes.append(cache.allocated)
        prompt = held_ids(prompt, got[0]) + [3, 4, 10 + index]
    assert sizes[0] == 12 and sizes == sorted(sizes) and sizes[-1] == LLAMA.max_length
    assert len(set(sizes)) < len(sizes)  # doubling: not a new cache every turn


def test_a_seeded_conversation_draws_the_same_tokens():
    """One random stream across the turns (as ``--chat - --seed``): the same draws either way."""
    model = lm(2)
    config = GenerationConfig(max_new_tokens=10, temperature=1.0)
    streams = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)]
    cache, replies = PrefixCache(), [[], []]
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
    for index in range(4):
        for side, prefix in enumerate((cache, None)):
            tokens = generate(model, prompts[side], config, generator=streams[side],
                              prefix_cache=prefix).tokens[0]
            replies[side].append(tokens)
            prompts[side] = prompts[side] + tokens + [3, 4, 20 + index]
        assert index == 0 or cache.kept > 0
    assert replies[0] == replies[1]


def test_each_case_that_cannot_keep_a_prefix_prefills_whole_and_says_why():
    model = lm()
    cache = PrefixCache()
    prompt = [5, 6, 7, 8, 9, 10]
    got, _ = turn(model, prompt, cache)
    held = held_ids(prompt, got[0])

    def falls_back(prompt, why: str, config: GenerationConfig = GREEDY, **kwargs) -> None:
        got, want = turn(model, prompt, cache, config, **kwargs)
        assert got == want
        width = max(len(row) for row in prompt) if isinstance(prompt[0], list) else len(prompt)
        assert (cache.kept, cache.prefilled) == (0, width)
        assert why in cache.fallback

    cache.reset()  # /reset
    falls_back(held + [3], "reset")
    held = held_ids(held + [3], generate(model, held + [3], GREEDY).tokens[0])
    falls_back([held, held], "the cache holds 1 rows, this call has 2")  # another batch size
    falls_back([held, held[:-2]], "left-padded")  # prompts of different lengths
    got, want = turn(model, [held, held[:-2]], cache)  # and again: never kept
    assert got == want and cache.kept == 0
    turn(model, held, cache)
    smaller = cache.allocated - 1  # a context the prompt fits, the cache does not
    falls_back(held + [4], f"more than this call's context of {smaller}",
               GREEDY.replace(context=smaller, max_new_tokens=2))
    # a window that slid: the cache holds re-based positions
    long = torch.randint(3, 50, (20,)).tolist()
    sliding = GREEDY.replace(context=24, slide=True, max_new_tokens=12)
    turn(model, long, cache, sliding)
    falls_back(long + [4], "slid", sliding)
    turn(model, long, cache)
    model.double()
    falls_back(long + [4], "moved to another device or dtype")
    model.float()


def test_longrope_keeps_a_prefix_only_on_one_side_of_its_switch():
    """Keys cached below the original context were turned by the short factors, a prompt past it
    turns every key by the long ones: a full prefill there; past it on both sides, kept."""
    model = lm(rotary_fraction=0.75, rope_scaling=LONGROPE, max_length=48)
    cache = PrefixCache()
    config = GREEDY.replace(max_new_tokens=4)
    prompt = [5, 6, 7, 8, 9, 10]
    got, want = turn(model, prompt, cache, config)
    assert got == want
    below = held_ids(prompt, got[0]) + [3, 4]  # 11 ids: still short
    got, want = turn(model, below, cache, config)
    assert got == want and cache.kept == 9
    across = held_ids(below, got[0]) + [3, 4, 20, 21, 22, 23]  # 20 ids: past the switch at 16
    got, want = turn(model, across, cache, config)
    assert got == want and cache.kept == 0 and "LongRoPE" in cache.fallback
    beyond = held_ids(across, got[0]) + [3, 4]  # the cached keys are long too now
    got, want = turn(model, beyond, cache, config)
    assert got == want and cache.kept == 23
    # a reply that crosses the switch rebuilds the cache: its keys are long, the next prompt too
    cache.reset()
    crossing = list(range(5, 17))  # 12 ids + 8 new: crosses 16 while generating
    got, want = turn(model, crossing, cache, GREEDY)
    assert got == want and cache.held > 16
    got, want = turn(model, held_ids(crossing, got[0]) + [3], cache, config)
    assert got == want and cache.kept == 19


def test_linear_attention_state_is_not_cut_back():
    model = lm(attention="linear", n_kv_heads=None)
    cache = PrefixCache()
    prompt = [5, 6, 7, 8, 9]
    got, want = turn(model, prompt, cache)
    got, want = turn(model, held_ids(prompt, got[0])[:8] + [3], cache)
    assert got == want and cache.kept == 0 and "recurrent state" in cache.fallback


def test_cuda_graph_steps_own_their_caches_and_prefill_whole():
    """``GraphedSteps`` (their CPU form: the same fixed-shape steps without a graph) hand a cache
    to the next call of its shape, so a ``PrefixCache`` keeps nothing there."""
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = lm()
    steps, cache = GraphedSteps(use_graph=False), PrefixCache()
    prompt = [5, 6, 7, 8, 9]
    for index in range(3):
        got = generate(model, prompt, GREEDY, steps=steps, prefix_cache=cache).tokens
        assert got == generate(model, prompt, GREEDY).tokens
        assert cache.kept == 0 and cache.held == 0
        if index:
            assert "GraphedSteps owns its caches" in cache.fallback
        prompt = held_ids(prompt, got[0]) + [3, 4]


def test_an_engine_passes_the_prefix_cache_to_its_steps():
    from aiayn.fast import InferenceOptions, prepare_for_inference

    model = lm()
    engine = prepare_for_inference(model, InferenceOptions(compile=True))
    engine.decode_step.compiled = engine.decode_step.plain  # the plumbing, without compiling
    cache, prompt = PrefixCache(), [5, 6, 7, 8, 9]
    for index in range(3):
        got = engine.generate(prompt, GREEDY, prefix_cache=cache).tokens
        assert got == generate(model, prompt, GREEDY).tokens
        assert cache.kept == (0 if index == 0 else len(prompt) - 2)
        prompt = held_ids(prompt, got[0]) + [3, 4]


@pytest.mark.slow  # compiles (tens of seconds on 2 cores)
def test_compiled_steps_keep_the_prefix_and_give_the_eager_tokens():
    """``aiayn generate --compile``'s steps: the compiled one-token step on caches of growing
    sizes, after a prefill of the rest."""
    from aiayn.fast.inference import CompiledStep, InferenceOptions

    model = lm()
    steps = Steps(CompiledStep(decode_step, InferenceOptions(compile=True)))
    cache, prompt = PrefixCache(), [5, 6, 7, 8, 9]
    for index in range(4):
        got = generate(model, prompt, GREEDY, steps=steps, prefix_cache=cache).tokens
        assert got == generate(model, prompt, GREEDY).tokens
        assert index == 0 or cache.kept == len(prompt) - 2
        prompt = held_ids(prompt, got[0]) + [3, 4]
    assert not steps.step.failed


def test_a_prefix_cache_serves_one_model():
    cache = PrefixCache()
    generate(lm(), [5, 6, 7], GREEDY, prefix_cache=cache)
    with pytest.raises(ValueError, match="holds the keys of another model.*reset"):
        generate(lm(1), [5, 6, 7], GREEDY, prefix_cache=cache)
    cache.reset()
    generate(lm(1), [5, 6, 7], GREEDY, prefix_cache=cache)  # forgotten: any model


def test_a_call_that_fails_part_way_leaves_nothing_to_keep():
    model = lm()
    cache = PrefixCache()
    generate(model, [5, 6, 7, 8], GREEDY, prefix_cache=cache)

    def broken(step, tokens, finished):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, [5, 6, 7, 8, 9], GREEDY, prefix_cache=cache, on_step=broken)
    assert cache.held == 0
    got, want = turn(model, [5, 6, 7, 8, 9, 10], cache)
    assert got == want and cache.kept == 0 and "failed part-way" in cache.fallback


# --- aiayn generate RUN_DIR --chat -: the conversation's replies with and without the cache ----

class TemplateVocabulary:
    """A chat template over one id per character: each message is <start> role text <end>, the
    prompt ends with <start> assistant. Generated ids below 10 or above 36 decode to nothing, so
    the template re-encodes a reply to other ids than those generated (as a real tokenizer
    may)."""

    START, END, ROLES = 1, 2, {"system": 3, "user": 4, "assistant": 5}

    LETTERS = "abcdefghijklmnopqrstuvwxyz "  # ids 10..36

    def decode(self, ids) -> str:
        return "".join(self.LETTERS[i - 10] for i in ids if 10 <= i < 10 + len(self.LETTERS))

    def encode_chat(self, messages) -> list[int]:
        ids = []
        for message in messages:
            ids += [self.START, self.ROLES[message["role"]],
                    *(10 + self.LETTERS.index(c) for c in message["content"]), self.END]
        return ids + [self.START, self.ROLES["assistant"]]


def chat(monkeypatch, capsys, kept_positions, model, stdin: str, *, reuse: bool,
         seed: int | None = None) -> tuple[str, list[int]]:
    """``generate.converse`` (what ``--chat -`` runs) on ``stdin``: stdout and, per reply, the
    positions its call kept (from the ``kept_positions`` fixture's record)."""
    from aiayn.commands import generate as command
    from aiayn.fast import InferenceOptions, prepare_for_inference

    before = len(kept_positions)
    config = GenerationConfig(max_new_tokens=6, greedy=seed is None, seed=seed, stop_ids=(2,),
                              slide=True)
    session = command.Session(
        inference=prepare_for_inference(model, InferenceOptions(compile=False)),
        vocabulary=TemplateVocabulary(), context=model.config.max_length, config=config,
        stops=command.StopStrings([]), stream=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    command.converse(session, argparse.Namespace(device="cpu", system="be brief",
                                                 no_prefix_cache=not reuse))
    return capsys.readouterr().out, kept_positions[before:]


@pytest.mark.parametrize("seed", [None, 3])
def test_a_conversation_replies_the_same_with_and_without_the_cache(monkeypatch, capsys, seed,
                                                                  kept_positions):
    model = lm(vocab_size=40)
    stdin = "hello\nhow are you\nwhat now\n/reset\nagain\nand more\n"
    with_cache, kept = chat(monkeypatch, capsys, kept_positions, model, stdin, reuse=True,
                            seed=seed)
    without, none = chat(monkeypatch, capsys, kept_positions, model, stdin, reuse=False,
                         seed=seed)
    assert with_cache == without and with_cache.count("\n") == 5
    assert none == []
    assert kept[0] == 0 and kept[1] > 0 and kept[2] > 0  # turns 2 and 3 keep the turns before
    assert kept[3] == 0  # /reset drops the cache
    assert kept[4] > 0


def test_the_conversation_drops_old_turns_and_still_replies_as_without_the_cache(
        monkeypatch, capsys, kept_positions):
    """A context of 40 holds a turn or two: the oldest turns go, so the ids after the system
    message change; the system message's 11 ids and the next turn's <start> user are kept."""
    model = lm(vocab_size=40, max_length=40)
    stdin = "hello there\nhow are you today\nwhat now then\nand more still\n"
    with_cache, kept = chat(monkeypatch, capsys, kept_positions, model, stdin, reuse=True)
    without, _ = chat(monkeypatch, capsys, kept_positions, model, stdin, reuse=False)
    assert with_cache == without
    assert with_cache.count("\n") == 4
    # after the first drop the ids share the system message and the user turn's opening only
    assert kept[1] > 13 and kept[2:] == [13, 13]


def test_no_prefix_cache_goes_with_a_conversation():
    from aiayn.commands.generate import check_request

    args = argparse.Namespace(chat="hi", prompt=None, system=None, no_prefix_cache=True)
    with pytest.raises(ValueError, match="--no-prefix-cache goes with --chat -"):
        check_request(args)


def test_the_benchmark_times_both_sides_of_each_turn(tmp_path):
    """benchmarks/chat_prefix.py at its smallest: both sides' times, the positions prefilled."""
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "chat_prefix.json"
    env = {**os.environ, "PYTHONPATH": str(repo / "src"), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "chat_prefix.py"), "--scale",
                           "0.1", "--turns", "3", "--message", "6", "--new", "3", "--rounds", "1",
                           "--out", str(out)], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [turn["turn"] for turn in results["turns"]] == [1, 2, 3]
    assert all(turn["prefix_cache"] > 0 and turn["full_prefill"] > 0 for turn in results["turns"])
    first, *later = results["turns"]
    assert first["prefilled"] == first["prompt"]
    # the reply's last token (never fed), <end>, <start> user, the message, <end>, <start> assistant
    assert all(turn["prefilled"] == 1 + 1 + 2 + 6 + 1 + 2 for turn in later)
    assert results["conversation"]["ratio"] > 0 and "chat_prefix.py" in results["command"]
