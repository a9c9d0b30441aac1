"""The band (a sliding window): every kernel's ``band=W`` equals attention under the mask
|i - j| < W (with ``causal``: 0 <= i - j < W) written out here, forward and backward; the fused
kernel's block-by-block path runs when the band is narrow and gives the same numbers, also with
grouped heads, padding, rows with nothing to attend to, lengths that are not a multiple of W; the
chunked kernel scores only the key tiles within the band, with no (S, S) mask;
whole encoders and decoders agree across kernels, and a decoder's cached steps after a banded
prefill equal its full forward."""

import pytest
import torch

from aiayn import CausalLM, SequenceClassifier, TransformerConfig, TransformerEncoder
from aiayn.nn.attention import banded, kernels
from aiayn.nn.attention.chunked import ChunkedAttention
from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention, swap_exact_kernels
from aiayn.nn.attention.linear import LinearAttention
from aiayn.nn.attention.sparse import SparseAttention


def by_hand(q, k, v, real, window, causal=False):
    """softmax over the keys with |i - j| < window (causal: 0 <= i - j < window) that are real;
    zeros for a query with none."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    length = q.shape[2]
    i = torch.arange(length)
    distance = i[:, None] - i[None, :]
    band = (distance >= 0) & (distance < window) if causal else distance.abs() < window
    allowed = band & real[:, None, None, :]  # (B, 1, S, S)
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return weights @ v


def inputs(batch, heads, kv_heads, length, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, 8, generator=generator, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, 8, generator=generator, dtype=dtype)
            for _ in range(2))
    real = torch.rand(batch, length, generator=generator) > 0.25
    real[0] = False  # a row of padding only: every query of it has nothing to attend to
    return [t.requires_grad_() for t in (q, k, v)], real


@pytest.fixture
def blocks_used(monkeypatch):
    """How many times the fused kernel took the block-by-block path."""
    calls = []
    plain = banded.banded_attention

    def spy(attend, q, k, v, keys_allowed, window, causal=False):
        calls.append(window if not causal else ("causal", window))
        return plain(attend, q, k, v, keys_allowed, window, causal)

    monkeypatch.setattr(kernels, "banded_attention", spy)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["both sides", "causal"])
@pytest.mark.parametrize("kernel", [ReferenceAttention(), FusedAttention(), ChunkedAttention(7)],
                         ids=["reference", "fused", "chunked"])
@pytest.mark.parametrize("batch, heads, kv_heads, length, window", [
    (3, 4, 4, 50, 4),    # blocks of 4, 13 of them, the last one short
    (3, 4, 2, 37, 5),    # grouped key/value heads
    (2, 2, 1, 40, 1),    # each position sees only itself
    (2, 2, 2, 12, 4),    # 3 W: the whole mask, no blocks
    (2, 2, 2, 3, 4),     # shorter than the window: nothing is cut
])
def test_band_equals_the_mask_by_hand(kernel, batch, heads, kv_heads, length, window, causal,
                                     blocks_used):
    (q, k, v), real = inputs(batch, heads, kv_heads, length)
    expected = by_hand(q, k, v, real, window, causal)
    got = kernel(q, k, v, mask=real[:, None, None, :], causal=causal, band=window)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert not got[0].any()  # the row of padding: zeros, never NaN
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)),
                    torch.autograd.grad(expected.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    blocked = isinstance(kernel, FusedAttention) and length > 3 * window
    assert blocks_used == ([("causal", window) if causal else window] if blocked else [])


def test_the_chunked_kernel_scores_only_the_key_tiles_within_the_band(monkeypatch):
    """Chunks of 8, W = 5, 64 positions: each query tile scores the keys from W - 1 before its
    first query to W - 1 after its last (causal: to its last), and no (S, S) mask is built."""
    from aiayn.nn.attention import chunked

    def no_band_mask(*args, **kwargs):
        raise AssertionError("an (S, S) band mask was built")

    monkeypatch.setattr(kernels, "band_mask", no_band_mask)
    tiles = []
    plain = chunked._key_tiles

    def spy(causal, band, offset, q0, q1, key_length, chunk_size):
        keys = plain(causal, band, offset, q0, q1, key_length, chunk_size)
        tiles.append((q0, q1, keys))
        return keys

    monkeypatch.setattr(chunked, "_key_tiles", spy)
    (q, k, v), real = inputs(2, 2, 2, 64)
    for causal in (False, True):
        tiles.clear()
        got = ChunkedAttention(8)(q, k, v, mask=real[:, None, None, :], causal=causal, band=5)
        torch.testing.assert_close(got, by_hand(q, k, v, real, 5, causal), rtol=1e-10,
                                   atol=1e-10)
        assert [(q0, q1) for q0, q1, _ in tiles] == [(n, n + 8) for n in range(0, 64, 8)]
        for q0, q1, keys in tiles:
            assert all(a[1] == b[0] for a, b in zip(keys, keys[1:]))  # contiguous
            assert keys[0][0] == max(0, q0 - 4)
            assert keys[-1][1] == (q1 if causal else min(64, q1 + 4))
        scored = sum(k1 - k0 for _, _, keys in tiles for k0, k1 in keys)
        assert scored <= 8 * (8 + (4 if causal else 8))  # of 8 x 64 without the band


def test_blocks_without_padding_mask_and_in_float32(blocks_used):
    (q, k, v), _ = inputs(2, 3, 3, 100, dtype=torch.float32)
    real = torch.ones(2, 100, dtype=torch.bool)
    got = FusedAttention()(q, k, v, band=9)
    torch.testing.assert_close(got, by_hand(q, k, v, real, 9), rtol=1e-5, atol=1e-5)
    assert blocks_used == [9]


def test_a_per_query_mask_with_a_band_takes_the_whole_mask(blocks_used):
    """Only key masks go block by block; any other mask is combined with the band as it is."""
    (q, k, v), real = inputs(2, 2, 2, 30)
    per_query = real[:, None, :, None] & real[:, None, None, :]  # (B, 1, S, S)
    got = FusedAttention()(q, k, v, mask=per_query, band=3)
    expected = ReferenceAttention()(q, k, v, mask=per_query, band=3)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert blocks_used == []


def test_band_refusals():
    (q, k, v), _ = inputs(1, 2, 2, 10)
    with pytest.raises(ValueError, match="self-attention mask"):
        ReferenceAttention()(q[:, :, :4], k, v, band=2)
    for kernel in (LinearAttention(), SparseAttention("local", window=4)):
        with pytest.raises(ValueError, match="cannot restrict each query to a band"):
            kernel(q.detach(), k.detach(), v.detach(), band=2)


CONFIG = TransformerConfig.preset("tiny", vocab_size=60, max_length=128, positions="rotary",
                                  norm_first=True, sliding_window=6,
                                  sliding_window_layers=[0, 2], n_encoder_layers=3,
                                  rope_local_theta=10_000.0, dropout=0.0)


@pytest.mark.parametrize("model_class", [TransformerEncoder, SequenceClassifier])
def test_encoder_with_sliding_layers_is_the_same_model_in_every_exact_kernel(
        model_class, blocks_used):
    """A ModernBERT-shaped encoder over 100 positions (padded rows): the fused kernel's blocks give
    the reference kernel's outputs (whole (S, S) masks) and gradients."""
    torch.manual_seed(0)
    model = model_class(CONFIG.replace(num_labels=3)).double()
    ids = torch.randint(3, 60, (3, 100))
    real = torch.ones(3, 100, dtype=torch.bool)
    real[1, 70:] = real[2, 9:] = False

    def run():
        model.zero_grad()
        out = model(ids, padding_mask=real)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused, fused_grads = run()
    assert blocks_used == [6, 6]  # the two sliding layers
    swap_exact_kernels(model, "reference")
    reference, reference_grads = run()
    torch.testing.assert_close(fused, reference, rtol=1e-9, atol=1e-9)
    for a, b in zip(fused_grads, reference_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_compiled_encoder_with_blocks_equals_eager(blocks_used):
    """The blocks compile in one graph at any length (dynamic shapes)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerEncoder(CONFIG).eval()
    ids = torch.randint(3, 60, (2, 50))
    real = torch.ones(2, 50, dtype=torch.bool)
    real[1, 31:] = False
    with torch.no_grad():
        eager = model(ids, padding_mask=real)[0]
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")(
            ids, padding_mask=real)[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


DECODER = CONFIG.replace(n_encoder_layers=0, n_decoder_layers=3, n_kv_heads=2, tie_output=False)


def test_decoder_with_sliding_layers_blocks_the_whole_sequence_and_matches_its_cached_steps(
        blocks_used):
    """A Mistral / Gemma-shaped decoder over 100 left-padded positions: the fused kernel's causal
    blocks give the reference kernel's logits and gradients; prefilling 60 positions into a cache
    (blocks) and then stepping one token at a time (the window over cache slots as a mask) gives
    the full forward's logits."""
    torch.manual_seed(0)
    model = CausalLM(DECODER).double()
    ids = torch.randint(3, 60, (2, 100))
    real = torch.ones(2, 100, dtype=torch.bool)
    real[1, :30] = False  # left padding

    def run():
        model.zero_grad()
        logits = model(ids, padding_mask=real)
        logits.square().sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused, fused_grads = run()
    assert blocks_used == [("causal", 6)] * 2  # the two sliding layers
    with torch.no_grad():
        cache = model.new_cache(2, 100)
        steps = [model(ids[:, :60], padding_mask=real[:, :60], cache=cache)]
        steps += [model(ids[:, t:t + 1], padding_mask=real[:, :t + 1], cache=cache)
                  for t in range(60, 100)]
    assert blocks_used == [("causal", 6)] * 4  # the prefill's blocks; the steps take the mask
    torch.testing.assert_close(torch.cat(steps, 1)[real], fused[real], rtol=1e-9, atol=1e-9)
    swap_exact_kernels(model, "reference")
    reference, reference_grads = run()
    torch.testing.assert_close(fused, reference, rtol=1e-9, atol=1e-9)
    for a, b in zip(fused_grads, reference_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_a_band_with_a_cache_needs_the_whole_sequence():
    model = CausalLM(DECODER)
    attention = model.decoder.layers[0].self_attention
    cache = model.new_cache(1, 20).self_attention[0]
    x = torch.randn(1, 4, DECODER.d_model)
    with pytest.raises(ValueError, match="a band covers a whole sequence"):
        attention(x, causal=True, cache=cache, start=3, band=2)
