"""Cross-attention with its projections folded into the cached memory equals the unfolded layer."""

from __future__ import annotations

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.attention import folded_cross
from aiayn.attention.cache import DecoderCache
from aiayn.attention.folded_cross import FoldedCrossAttention, fold, worth_folding
from aiayn.attention.kernels import FusedAttention, ReferenceAttention
from aiayn.attention.multihead import MultiHeadAttention
from aiayn.decoding.beam import beam_search


def _attention(bias: bool = True, kernel=None) -> MultiHeadAttention:
    torch.manual_seed(0)
    attention = MultiHeadAttention(32, 4, kernel or FusedAttention(), cross=True, bias=bias).eval()
    with torch.no_grad():  # biases are zero-initialised: make them count
        for parameter in attention.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return attention


def _step(attention, x, memory, *, rows_per_memory, mask=None, folding=True, need_weights=False):
    """One cached step through a fresh cache, with folding on or off: (output, weights, cache)."""
    saved = folded_cross.folding_enabled
    folded_cross.folding_enabled = folding
    try:
        cache = DecoderCache([None], 4, rows_per_memory=rows_per_memory)
        with torch.no_grad():
            out, weights = attention(x, memory, mask=mask, cache=cache, need_weights=need_weights)
    finally:
        folded_cross.folding_enabled = saved
    return out, weights, cache


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows_per_memory, length", [(1, 1), (3, 1), (2, 2)])
def test_folded_step_equals_the_unfolded_layer(bias, rows_per_memory, length):
    attention = _attention(bias)
    sources, source_length = 2, 5
    memory = torch.randn(sources, source_length, 32)
    x = torch.randn(sources * rows_per_memory, length, 32)
    mask = torch.ones(sources, 1, 1, source_length, dtype=torch.bool)
    mask[1, ..., 3:] = False  # padded source keys
    folded, folded_weights, cache = _step(attention, x, memory, rows_per_memory=rows_per_memory,
                                          mask=mask, need_weights=True)
    plain, plain_weights, plain_cache = _step(attention, x, memory, rows_per_memory=rows_per_memory,
                                              mask=mask, folding=False, need_weights=True)
    assert isinstance(cache.cross[0], FoldedCrossAttention)
    assert isinstance(plain_cache.cross[0], tuple)
    assert folded.shape == plain.shape == (sources * rows_per_memory, length, 32)
    torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-5)
    assert folded_weights.shape == plain_weights.shape == (sources * rows_per_memory, 4, length,
                                                           source_length)
    torch.testing.assert_close(folded_weights, plain_weights, rtol=1e-5, atol=1e-6)
    assert folded_weights[rows_per_memory:, ..., 3:].abs().max() == 0  # padding gets no weight
    assert cache.source_length == plain_cache.source_length == source_length


def test_a_source_with_no_key_gives_the_output_bias_not_nan():
    attention = _attention(kernel=ReferenceAttention())
    memory, x = torch.randn(2, 4, 32), torch.randn(2, 1, 32)
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    mask[0] = False  # nothing to attend to: zero attention, as every kernel
    folded, _, _ = _step(attention, x, memory, rows_per_memory=1, mask=mask)
    plain, _, _ = _step(attention, x, memory, rows_per_memory=1, mask=mask, folding=False)
    assert torch.isfinite(folded).all()
    torch.testing.assert_close(folded[0, 0], attention.out_proj.bias.detach())
    torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-5)


def test_later_steps_reuse_the_folded_memory_and_follow_the_source_selection():
    attention = _attention()
    memory, mask = torch.randn(3, 6, 32), torch.ones(3, 1, 1, 6, dtype=torch.bool)
    mask[2, ..., 4:] = False
    rows = [torch.randn(6, 1, 32) for _ in range(3)]  # 3 sources x 2 rows each, 3 steps
    outputs = {}
    for folding in (True, False):
        folded_cross.folding_enabled = folding
        try:
            cache = DecoderCache([None], 4, rows_per_memory=2)
            with torch.no_grad():
                steps = [attention(rows[0], memory, mask=mask, cache=cache)[0]]
                kept = cache.cross[0]
                steps.append(attention(rows[1], None, mask=mask, cache=cache)[0])
                assert cache.cross[0] is kept  # computed on the first step only
                cache.select_sources(torch.tensor([0, 2]))  # the second sentence leaves
                steps.append(attention(rows[2][[0, 1, 4, 5]], None, mask=mask[[0, 2]],
                                       cache=cache)[0])
        finally:
            folded_cross.folding_enabled = True
        outputs[folding] = steps
    for folded, plain in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(folded, plain, rtol=1e-5, atol=1e-5)


def test_folded_decoding_equals_the_full_forward():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny")).eval()
    src, tgt = torch.randint(3, 100, (2, 8)), torch.randint(3, 100, (2, 8))
    src_mask = torch.ones(2, 8, dtype=torch.bool)
    src_mask[1, 6:] = False
    with torch.no_grad():
        full = model(src, tgt, src_padding_mask=src_mask)
        memory = model.encode(src, src_mask)
        cache = model.new_cache(batch=2, max_length=8)
        steps = [model.decode(tgt[:, t: t + 1], memory if t == 0 else None,
                              memory_padding_mask=src_mask, cache=cache) for t in range(8)]
    assert all(isinstance(kept, FoldedCrossAttention) for kept in cache.cross)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_beam_search_tokens_are_the_same_folded_or_not(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", vocab_size=40)).eval()
    src = torch.randint(3, 40, (3, 6))
    src_mask = torch.ones(3, 6, dtype=torch.bool)
    src_mask[2, 3:] = False
    folded = beam_search(model, src, src_mask, beam_size=3, max_extra=6)
    monkeypatch.setattr(folded_cross, "folding_enabled", False)
    plain = beam_search(model, src, src_mask, beam_size=3, max_extra=6)
    assert [h.tokens for h in folded] == [h.tokens for h in plain]
    torch.testing.assert_close(torch.tensor([h.score for h in folded]),
                               torch.tensor([h.score for h in plain]), rtol=1e-5, atol=1e-5)


def _kept_after_one_step(attention, memory, rows_per_memory=1, grad=False):
    cache = DecoderCache([None], 4, rows_per_memory=rows_per_memory)
    x = torch.randn(memory.shape[0] * rows_per_memory, 1, attention.d_model)
    with torch.set_grad_enabled(grad):
        attention(x, memory, cache=cache)
    return cache.cross[0]


def test_what_is_not_folded():
    memory = torch.randn(2, 5, 32)
    assert isinstance(_kept_after_one_step(_attention(), memory), FoldedCrossAttention)
    # under autograd (the fold would be part of the graph for no gain)
    assert isinstance(_kept_after_one_step(_attention(), memory, grad=True), tuple)
    # a kernel that is not eq. 1 (linear attention has no softmax to fold around)
    from aiayn.attention.linear import LinearAttention
    assert isinstance(_kept_after_one_step(_attention(kernel=LinearAttention()), memory), tuple)
    # a hook on a projection that folding would skip
    hooked = _attention()
    hooked.q_proj.register_forward_hook(lambda module, args, out: None)
    assert isinstance(_kept_after_one_step(hooked, memory), tuple)
    # attention dropout in training mode (folding has no weights to drop)
    dropped = _attention()
    dropped.dropout = 0.1
    dropped.train()
    assert isinstance(_kept_after_one_step(dropped, memory), tuple)
    # a long memory: the folded matrices would cost more than the projections they replace
    assert isinstance(_kept_after_one_step(_attention(), torch.randn(1, 40, 32)), tuple)


@pytest.mark.parametrize("heads, source_length, d_model, sources, expected", [
    # whole decoding steps, unfolded / folded time (worth_folding's docstring)
    (4, 32, 256, 1, True),  # one sentence: 1.09 greedy, 1.15 with 4 beams
    (4, 32, 256, 4, True),  # beam search of the benchmark (4 sources x 4 beams): 1.08
    (4, 64, 256, 2, True),  # 1.10
    (4, 32, 256, 8, False),  # 8 sources: 1.02 with 4 beams, 0.96 greedy
    (4, 32, 256, 16, False),  # 16 sentences greedy: 0.86
    (4, 64, 256, 4, False),  # 1.03: reads 2x the floats
    (4, 128, 256, 1, False),  # 0.92: H * S = 2 D, twice the arithmetic
])
def test_worth_folding_follows_the_measurements(heads, source_length, d_model, sources, expected):
    assert worth_folding(heads, source_length, d_model, sources) == expected


def test_fold_matches_its_formula_on_one_head():
    torch.manual_seed(0)
    query, output = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    keys, values = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)  # one head: Dh = D = 4
    with torch.no_grad():
        folded = fold(query, output, keys, values)
        x = torch.randn(1, 2, 4)
        scores = (query(x) @ keys[0, 0].T) / 2  # (1, 2, 3), s = 1 / sqrt(4)
        expected = output(scores.softmax(-1) @ values[0, 0])
        out, _ = folded.attend(x)
    assert folded.scores_weight.shape == (1, 4, 3) and folded.values.shape == (1, 3, 4)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
