"""Incremental decoding with the static KV cache reproduces the full forward pass at every position."""

import pytest
import torch

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn.nn.attention.cache import KVCache

NORMS = [pytest.param(False, id="post-norm"), pytest.param(True, id="pre-norm")]


def tiny(**overrides):
    return TransformerConfig.preset("tiny", **overrides)


@pytest.mark.parametrize("norm_first", NORMS)
@pytest.mark.parametrize("kernel", ["fused", "reference"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_decoder_only_cached_steps_equal_full_forward(norm_first, kernel, positions):
    model = CausalLM(tiny(norm_first=norm_first, attention=kernel, positions=positions)).eval()
    tokens = torch.randint(3, 100, (3, 12))
    full = model(tokens)
    cache = model.new_cache(batch=3, max_length=12)
    prefill = model(tokens[:, :5], cache=cache)  # a prompt in one go, then one token at a time
    steps = [model(tokens[:, t: t + 1], cache=cache) for t in range(5, 12)]
    cached = torch.cat([prefill] + steps, dim=1)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    assert cache.length == 12


@pytest.mark.parametrize("norm_first", NORMS)
@pytest.mark.parametrize("changes", [{}, dict(qk_norm=True, qkv_bias=True, bias=False)],
                         ids=["paper", "qk-norm"])
def test_encoder_decoder_cached_steps_equal_full_forward(norm_first, changes):
    """QK-norm also normalises cross-attention's queries and the memory's keys (cached once)."""
    model = Transformer(tiny(norm_first=norm_first, **changes)).eval()
    src, tgt = torch.randint(3, 100, (2, 9)), torch.randint(3, 100, (2, 8))
    src_mask = torch.ones(2, 9, dtype=torch.bool)
    src_mask[1, 6:] = False
    full = model(src, tgt, src_padding_mask=src_mask)
    memory = model.encode(src, src_mask)
    cache = model.new_cache(batch=2, max_length=8)
    first = model.decode(tgt[:, :1], memory, memory_padding_mask=src_mask, cache=cache)
    assert all(kv.keys is not None for kv in cache.cross)  # cross keys/values computed once ...
    cross_before = [kv.keys.data_ptr() for kv in cache.cross]
    # ... and reused: later steps need not even be given the memory.
    rest = [model.decode(tgt[:, t: t + 1], None, memory_padding_mask=src_mask, cache=cache)
            for t in range(1, 8)]
    assert [kv.keys.data_ptr() for kv in cache.cross] == cross_before
    torch.testing.assert_close(torch.cat([first] + rest, dim=1), full, rtol=1e-5, atol=1e-5)


def test_cached_decoding_with_left_padded_prompts():
    model = CausalLM(tiny(norm_first=True)).eval()
    prompt = torch.randint(3, 100, (2, 6))
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[0, :2] = False  # row 0 is a 4-token prompt, left-padded by 2
    positions = (padding[:, :6].long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(batch=2, max_length=10)
    logits = model(prompt, padding_mask=padding[:, :6], positions=positions, cache=cache)
    alone = model(prompt[:1, 2:])  # row 0 without its padding
    torch.testing.assert_close(logits[0, 2:], alone[0], rtol=1e-5, atol=1e-5)
    nxt = torch.randint(3, 100, (2, 1))
    step = model(nxt, padding_mask=padding[:, :7], positions=positions[:, -1:] + 1, cache=cache)
    alone_next = model(torch.cat([prompt[:1, 2:], nxt[:1]], dim=1))
    torch.testing.assert_close(step[0, 0], alone_next[0, -1], rtol=1e-5, atol=1e-5)


def test_cache_is_preallocated_and_written_in_place():
    model = CausalLM(tiny())
    cache = model.new_cache(batch=1, max_length=16)
    pointers = [layer.keys.data_ptr() for layer in cache.self_attention]
    with torch.no_grad():
        for t in range(4):
            model(torch.randint(3, 100, (1, 1)), cache=cache)
    assert [layer.keys.data_ptr() for layer in cache.self_attention] == pointers
    assert cache.self_attention[0].keys.shape == (1, 4, 16, 8)


def test_cache_overflow_and_position_table_errors():
    model = CausalLM(tiny()).eval()
    cache = model.new_cache(batch=1, max_length=4)
    model(torch.randint(3, 100, (1, 3)), cache=cache)
    with pytest.raises(ValueError, match="overflows the cache of 4"):
        model(torch.randint(3, 100, (1, 2)), cache=cache)
    with pytest.raises(ValueError, match="exceeds the position table"):
        model.new_cache(batch=1, max_length=65)
    with pytest.raises(ValueError, match="overflows it"):
        KVCache(1, 1, 2, 4).write(1, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))


def test_reorder_selects_rows_like_beam_search():
    model = Transformer(tiny()).eval()
    src, tgt = torch.randint(3, 100, (3, 5)), torch.randint(3, 100, (3, 4))
    memory = model.encode(src)
    cache = model.new_cache(batch=3, max_length=4)
    model.decode(tgt[:, :2], memory, cache=cache)
    order = torch.tensor([2, 2, 0])
    cache.reorder(order)
    stepped = model.decode(tgt[order, 2:3], None, cache=cache)
    full = model(src[order], torch.cat([tgt[order, :2], tgt[order, 2:3]], 1))
    torch.testing.assert_close(stepped[:, 0], full[:, 2], rtol=1e-5, atol=1e-5)
