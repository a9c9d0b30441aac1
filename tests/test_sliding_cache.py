"""A sliding-window layer's KV cache is a ring of W slots (``SlidingKVCache``).

Against independent references: what the ring returns is, exactly, the keys and values of the
positions ``key_slots`` names (a plain ``KVCache`` written alike), over runs of one token and of
several, wrapped many times; a decoder on rings gives the logits of its full forward (prefills in
chunks past the window, then steps) for every exact kernel, and ``generate`` the tokens of the
same decoder on caches that keep every position (plain steps, fixed-shape slot steps, left
padding, a slide); reordered rows decode as the reordered batch; a ``PrefixCache`` keeps a prefix
where the ring still holds what the rest of the prompt reads, and says why not where it does not;
a sliding layer's cache is W slots, by hand.
"""

from __future__ import annotations

import pytest
import torch

from aiayn import CausalLM, TransformerConfig
from aiayn.decoding.generation import GenerationConfig, Steps, generate
from aiayn.decoding.prefix_cache import PrefixCache
from aiayn.fast.cuda_graphs import GraphedSteps
from aiayn.nn.attention.cache import KVCache, SlidingKVCache
from aiayn.nn.attention.linear import LinearAttention

pytestmark = pytest.mark.usefixtures("one_thread")

# Layers 0 and 2 slide over W = 4 positions, layer 1 attends to everything (as Gemma 3 mixes them).
WINDOWED = TransformerConfig.preset(
    "llama-char", vocab_size=50, d_model=64, n_heads=8, n_kv_heads=2, d_ff=96, n_decoder_layers=3,
    max_length=64, init_std=0.2, sliding_window=4, sliding_window_layers=[0, 2])
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def lm(seed: int = 0, **changes) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(WINDOWED.replace(**changes)).eval()


class EveryPosition(Steps):
    """Plain steps on caches that keep every position in every layer (the plain ``KVCache``)."""

    def new_cache(self, model, batch, capacity):
        cache = model.new_cache(batch, capacity)
        cache.self_attention = [KVCache(batch, layer.keys.shape[1], capacity, layer.keys.shape[3])
                                for layer in cache.self_attention]
        return cache


def test_the_ring_returns_exactly_the_keys_of_the_positions_it_names():
    torch.manual_seed(0)
    window, length = 3, 24
    keys, values = torch.randn(2, 1, length, 4), torch.randn(2, 1, length, 4)  # by position
    ring = SlidingKVCache(2, 1, length, 4, window)
    assert ring.keys.shape == (2, 1, window, 4) and ring.capacity == length
    runs = [(0, 5), (5, 1), (6, 1), (7, 1), (8, 4), (12, 1), (13, 2), (15, 1), (16, 1), (17, 7)]
    for start, count in runs:
        got_keys, got_values = ring.write(start, keys[:, :, start:start + count],
                                          values[:, :, start:start + count])
        slots = ring.key_slots(start, count)
        assert (slots >= 0).all() and got_keys.shape[2] == slots.numel()
        assert torch.equal(got_keys, keys[:, :, slots]) and torch.equal(got_values,
                                                                       values[:, :, slots])
        # every key a new query reads is there: window - 1 behind the first, up to the last
        needed = set(range(max(0, start - window + 1), start + count))
        assert needed <= set(slots.tolist())
        if count > 1:  # a run: in position order, so the kernel's right-aligned causal mask holds
            assert slots.tolist() == sorted(slots.tolist()) and slots[-1] == start + count - 1


def test_fixed_shape_steps_name_every_slot_and_the_empty_ones_negative():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 10, 4)
    ring = SlidingKVCache(1, 2, 10, 4, 4)
    for position in range(10):
        got, _ = ring.write(torch.tensor([position]), keys[:, :, position:position + 1],
                            keys[:, :, position:position + 1])
        slots = ring.key_slots(torch.tensor([position]), 1)
        assert got.shape[2] == 4
        assert sorted(slots.tolist()) == list(range(position - 3, position + 1))
        held = slots >= 0
        assert torch.equal(got[:, :, held], keys[:, :, slots[held]])


def test_a_sliding_layers_cache_is_w_slots_and_a_full_layers_every_position():
    model = lm(n_decoder_layers=6, sliding_window=16, sliding_window_layers=[0, 1, 2, 3, 4])
    cache = model.new_cache(batch=2, max_length=64)
    kinds = [type(layer) for layer in cache.self_attention]
    assert kinds == [SlidingKVCache] * 5 + [KVCache]
    per_slot = 2 * 2 * 2 * 8 * 4  # keys and values, 2 rows, 2 key/value heads of 8, float32
    assert sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.self_attention) == \
        per_slot * (5 * 16 + 64)
    # no room past the window: nothing to gain from a ring
    assert all(type(layer) is KVCache for layer in model.new_cache(2, 16).self_attention)


@pytest.mark.parametrize("attention", ["fused", "reference", "chunked"])
def test_decoding_on_rings_in_runs_and_steps_gives_the_full_forwards_logits(attention):
    model = lm(attention=attention, attention_chunk_size=4)
    torch.manual_seed(1)
    ids = torch.randint(3, 50, (2, 40))
    cache = model.new_cache(2, 40)
    assert isinstance(cache.self_attention[0], SlidingKVCache)
    runs = [7, 1, 1, 1, 5, 1, 3, 1, 1, 9, 1, 1, 1, 1, 6]  # 40 positions: runs cross the ring
    with torch.no_grad():
        full = model(ids)
        pieces, start = [], 0
        for count in runs:
            pieces.append(model(ids[:, start:start + count], cache=cache))
            start += count
    assert start == 40 and cache.length == 40
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps", ["plain", "slots"])
def test_generation_on_rings_gives_the_tokens_of_caches_that_keep_every_position(steps):
    """Left-padded prompts, 40 new tokens past a window of 4 (the ring wraps ten times)."""
    model = lm()
    runner = Steps() if steps == "plain" else GraphedSteps(use_graph=False)
    config = GenerationConfig(max_new_tokens=40, greedy=True)
    got = generate(model, PROMPTS, config, steps=runner).tokens
    assert got == generate(model, PROMPTS, config, steps=EveryPosition()).tokens
    assert got == [generate(model, [prompt], config).tokens[0] for prompt in PROMPTS]
    # the window matters: the same weights attending to everything continue otherwise
    unwindowed = lm(sliding_window=None, sliding_window_layers=None)
    assert got != generate(unwindowed, PROMPTS, config).tokens


def test_sliding_past_the_context_on_rings_gives_the_tokens_of_full_caches():
    model = lm()
    config = GenerationConfig(max_new_tokens=30, greedy=True, context=12, slide=True)
    for runner in (Steps(), GraphedSteps(use_graph=False)):
        assert generate(model, PROMPTS, config, steps=runner).tokens == \
            generate(model, PROMPTS, config, steps=EveryPosition()).tokens


def test_reordered_rows_decode_as_the_reordered_batch():
    model = lm()
    torch.manual_seed(2)
    ids = torch.randint(3, 50, (3, 14))
    order = torch.tensor([2, 0, 0])
    cache = model.new_cache(3, 14)
    with torch.no_grad():
        model(ids[:, :9], cache=cache)
        for t in range(9, 12):
            model(ids[:, t:t + 1], cache=cache)
        cache.reorder(order)
        got = torch.cat([model(ids[order, t:t + 1], cache=cache) for t in (12, 13)], dim=1)
        want = model(ids[order])[:, 12:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prefix_cache_keeps_what_the_ring_still_holds_and_says_why_not_otherwise():
    model = lm()
    greedy = GenerationConfig(max_new_tokens=8, greedy=True)
    cache = PrefixCache()

    def turn(prompt):
        got = generate(model, prompt, greedy, prefix_cache=cache).tokens
        assert got == generate(model, prompt, greedy).tokens
        return prompt + got[0][:-1]  # the ids the cache holds: the last new token is not fed

    held = turn([5, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # 17 positions: the rings have wrapped
    assert len(held) == 17
    held = turn(held + [3, 4, 20])  # every cached id shared: all kept
    assert (cache.kept, cache.fallback) == (17, None)
    other = 3 if held[-1] != 3 else 4
    before = len(held)
    held = turn(held[:-1] + [other, 30])  # all but the last cached id shared: one slot rewound
    assert (cache.kept, cache.fallback) == (before - 1, None)
    turn(held[:10] + [31, 32, 33])  # parts after 10 of the cached ids: overwritten in the ring
    assert cache.kept == 0 and "sliding-window layer's ring" in cache.fallback


def test_a_prefix_cache_grows_from_plain_caches_into_rings():
    """Turn one fits the window (plain caches), turn two does not (rings): the kept positions move
    into the rings' slots."""
    model = lm(sliding_window=16)
    greedy = GenerationConfig(max_new_tokens=6, greedy=True)
    cache = PrefixCache()
    first = [5, 6, 7, 8, 9, 10]
    got = generate(model, first, greedy, prefix_cache=cache).tokens
    assert cache.allocated == 11 and cache.allocated <= 16
    second = first + got[0][:-1] + [3, 4] + list(range(20, 32))  # 11 held, 14 new
    got = generate(model, second, greedy, prefix_cache=cache).tokens
    assert got == generate(model, second, greedy).tokens
    assert cache.kept == 11 and cache.allocated > 16


def test_bad_windows_and_overflows_are_refused():
    with pytest.raises(ValueError, match="window must be a positive integer"):
        SlidingKVCache(1, 1, 8, 4, 0)
    ring = SlidingKVCache(1, 1, 8, 4, 3)
    with pytest.raises(ValueError, match="overflows it"):
        ring.write(6, torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    with pytest.raises(ValueError, match="linear attention cannot restrict"):
        LinearAttention().new_cache(1, 1, 8, 4, window=3)
