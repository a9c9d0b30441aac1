"""The speed-motivated shortcuts of the core (issue 6) compute exactly what the plain path computes.

- inactive dropout (eval mode, or p = 0) is skipped instead of called: outputs equal a model whose
  dropout modules are called explicitly; active dropout still drops;
- the KV cache writes and reads through ``narrow`` views: equal to slice assignment;
- ``KVCache.reorder`` gathers the filled prefix into a spare buffer and swaps: equal to index_select;
- a cache with ``rows_per_memory`` shares cross-attention keys/values among beams: equal to decoding
  with the memory repeated per row, at every step, through reorders and sentences leaving;
- the vocabulary-major output projection (no grad, few rows): equal to ``linear``;
- beam search on the shared-memory cache: the same hypotheses and scores as the plain cache;
- oneDNN linear layers with the FFN activation fused (CPU inference, many rows): equal to
  ``nn.Linear`` + activation, and whole models equal with the path switched off (training through
  oneDNN: tests/test_onednn_linear.py);
- the fused q/k/v (and cross k/v) projection split by ``split`` + per-part views: output and
  gradients equal to the former ``view(B, T, 3, H, Dh).permute(...).unbind`` layout.
"""
import pytest

import torch
from torch import nn

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn import inference_linear, layers, onednn_linear
from aiayn.attention import folded_cross
from aiayn.attention.cache import KVCache
from aiayn.decoding import beam as beam_module
from aiayn.models.heads import OutputProjection
from aiayn.feedforward import FeedForward
from aiayn.feedforward import activation_function
from aiayn.layers import Residual
from aiayn.models import TransformerEncoder


def _plain_residual(residual: Residual, x, sublayer):
    if residual.norm_first:
        return x + residual.dropout(sublayer(residual.norm(x)))
    return residual.norm(x + residual.dropout(sublayer(x)))


def test_residual_skips_inactive_dropout_with_identical_output():
    for norm_first in (False, True):
        config = TransformerConfig.preset("tiny", norm_first=norm_first, dropout=0.3)
        residual = Residual(config).eval()
        x = torch.randn(2, 5, 32)
        sublayer = nn.Linear(32, 32)
        assert torch.equal(residual(x, sublayer), _plain_residual(residual, x, sublayer))


def test_active_dropout_is_still_applied_in_training():
    config = TransformerConfig.preset("tiny", dropout=0.5, activation_dropout=0.5)
    residual = Residual(config).train()
    x = torch.randn(4, 16, 32)
    torch.manual_seed(1)
    skipped = residual(x, lambda h: h)
    torch.manual_seed(1)
    plain = _plain_residual(residual, x, lambda h: h)
    assert torch.equal(skipped, plain)  # same random stream: the dropout module was called
    assert not torch.equal(skipped, residual.norm(x + x))  # and it dropped something
    feedforward = FeedForward(32, 64, dropout=0.5).train()
    torch.manual_seed(2)
    out = feedforward(x)
    torch.manual_seed(2)
    expected = feedforward.linear2(feedforward.dropout(feedforward.activation(feedforward.linear1(x))))
    assert torch.equal(out, expected)


def test_models_in_eval_ignore_dropout_settings():
    tokens = torch.randint(3, 100, (2, 10))
    torch.manual_seed(0)
    with_dropout = CausalLM(TransformerConfig.preset("tiny", norm_first=True, dropout=0.4,
                                                     activation_dropout=0.4)).eval()
    torch.manual_seed(0)
    without = CausalLM(TransformerConfig.preset("tiny", norm_first=True, dropout=0.0)).eval()
    assert torch.equal(with_dropout(tokens), without(tokens))
    src = torch.randint(3, 100, (2, 7))
    torch.manual_seed(0)
    seq2seq = Transformer(TransformerConfig.preset("tiny", dropout=0.4)).eval()
    torch.manual_seed(0)
    plain = Transformer(TransformerConfig.preset("tiny", dropout=0.0)).eval()
    assert torch.equal(seq2seq(src, tokens), plain(src, tokens))


def test_kv_cache_narrow_write_equals_slice_assignment():
    cache = KVCache(2, 3, 10, 4)
    keys, values = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10, 4)
    read_k, read_v = cache.write(0, keys[:, :, :6], values[:, :, :6])
    read_k, read_v = cache.write(6, keys[:, :, 6:7], values[:, :, 6:7])
    assert torch.equal(read_k, keys[:, :, :7]) and torch.equal(read_v, values[:, :, :7])
    assert read_k.data_ptr() == cache.keys.data_ptr()  # a view, not a copy
    assert torch.equal(cache.keys[:, :, 7:], torch.zeros(2, 3, 3, 4))


def test_kv_cache_reorder_in_place_equals_index_select():
    cache = KVCache(4, 2, 6, 3)
    keys, values = torch.randn(4, 2, 6, 3), torch.randn(4, 2, 6, 3)
    cache.write(0, keys[:, :, :4], values[:, :, :4])
    buffers = {cache.keys.data_ptr(), cache.values.data_ptr()}
    for index in (torch.tensor([1, 1, 3, 0]), torch.tensor([2, 0, 0, 1])):
        expected_keys, expected_values = cache.keys.index_select(0, index), \
            cache.values.index_select(0, index)
        with torch.no_grad():
            cache.reorder(index, filled=4)
        torch.testing.assert_close(cache.keys[:, :, :4], expected_keys[:, :, :4], rtol=0, atol=0)
        torch.testing.assert_close(cache.values[:, :, :4], expected_values[:, :, :4], rtol=0, atol=0)
        buffers |= {cache.keys.data_ptr(), cache.values.data_ptr()}
    assert len(buffers) == 4  # two buffers per tensor, swapped: nothing allocated after the first
    with torch.no_grad():
        cache.reorder(torch.tensor([3, 0]), filled=4)  # a smaller batch: new tensors, same rows
    assert cache.keys.shape == (2, 2, 6, 3)


@pytest.mark.parametrize("folding", [True, False])
def test_shared_memory_cache_equals_repeated_memory(folding, monkeypatch):
    monkeypatch.setattr(folded_cross, "folding_enabled", folding)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny")).eval()
    beams, sources = 3, 2
    src = torch.randint(3, 100, (sources, 7))
    src_mask = torch.ones(sources, 7, dtype=torch.bool)
    src_mask[1, 4:] = False
    tgt = torch.randint(3, 100, (sources * beams, 5))
    with torch.no_grad():
        memory = model.encode(src, src_mask)  # (2, S, D)
        shared = model.new_cache(sources * beams, 5, rows_per_memory=beams)
        plain = model.new_cache(sources * beams, 5)
        repeated, repeated_mask = memory.repeat_interleave(beams, 0), src_mask.repeat_interleave(beams, 0)
        for step, order in enumerate([None, torch.tensor([2, 2, 0, 5, 3, 3]), None,
                                      torch.tensor([1, 0, 0, 4, 4, 5])]):
            if order is not None:
                shared.reorder(order, cross=False)
                plain.reorder(order)
            fast = model.decode(tgt[:, step:step + 1], memory if step == 0 else None,
                                memory_padding_mask=src_mask, cache=shared)
            slow = model.decode(tgt[:, step:step + 1], repeated if step == 0 else None,
                                memory_padding_mask=repeated_mask, cache=plain)
            torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        # the second sentence leaves: select its source and its rows
        shared.select_sources(torch.tensor([0]))
        shared.reorder(torch.tensor([0, 1, 2]), cross=False)
        plain.reorder(torch.tensor([0, 1, 2]))
        fast = model.decode(tgt[:3, 4:5], None, memory_padding_mask=src_mask[:1], cache=shared)
        slow = model.decode(tgt[:3, 4:5], None, memory_padding_mask=repeated_mask[:3], cache=plain)
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    kept = shared.cross[0]
    assert isinstance(kept, folded_cross.FoldedCrossAttention) == folding
    assert (kept.sources if folding else kept[0].shape[0]) == 1  # one memory row per source
    try:
        shared.reorder(torch.tensor([0, 1, 2]))  # cross=True on a shared cache: refused
    except ValueError as error:
        assert "select_sources" in str(error)
    else:
        raise AssertionError("reorder(cross=True) of a shared-memory cache must raise")


def test_vocabulary_major_projection_equals_linear():
    torch.manual_seed(0)
    for output_bias in (True, False):
        config = TransformerConfig.preset("tiny", output_bias=output_bias)
        projection = OutputProjection(config, nn.Embedding(100, 32), tied=True)
        if output_bias:
            nn.init.normal_(projection.bias)
        for shape in ((1, 32), (4, 1, 32), (3, 5, 32), (70, 32)):
            hidden = torch.randn(shape)
            plain = nn.functional.linear(hidden, projection.weight, projection.bias)
            with torch.no_grad():
                fast = projection(hidden)
            assert fast.shape == plain.shape and fast.is_contiguous()
            torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_beam_search_on_shared_memory_equals_plain_cache():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", vocab_size=40)).eval()
    src = torch.randint(3, 40, (3, 6))
    src_mask = torch.ones(3, 6, dtype=torch.bool)
    src_mask[2, 3:] = False
    fast = beam_module.beam_search(model, src, src_mask, beam_size=3, max_extra=6)

    class PlainCacheModel(nn.Module):
        """The model with the memory repeated per beam and a plain (unshared) cache."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def encode(self, source, mask):
            return self.inner.encode(source, mask)

        def new_cache(self, batch, max_length, rows_per_memory=1):
            self.beams = rows_per_memory
            return _RepeatingCache(self.inner.new_cache(batch, max_length), rows_per_memory)

        def decode(self, tokens, memory, memory_padding_mask=None, cache=None):
            if memory is not None:
                memory = memory.repeat_interleave(self.beams, 0)
            mask = memory_padding_mask.repeat_interleave(self.beams, 0)
            return self.inner.decode(tokens, memory, memory_padding_mask=mask, cache=cache.inner)

    slow = beam_module.beam_search(PlainCacheModel(model), src, src_mask, beam_size=3, max_extra=6)
    assert [h.tokens for h in fast] == [h.tokens for h in slow]
    # grouped cross-attention sums in another order: scores agree to float32 rounding
    torch.testing.assert_close(torch.tensor([h.score for h in fast]),
                               torch.tensor([h.score for h in slow]), rtol=1e-5, atol=1e-5)


class _RepeatingCache:
    """A plain DecoderCache driven through the shared-memory calls of beam search."""

    def __init__(self, inner, beams):
        self.inner, self.beams, self.sources = inner, beams, None

    def select_sources(self, index):
        self.sources = index

    def reorder(self, index, cross=True):
        self.inner.reorder(index)  # plain cache: cross rows follow the rows, as before the change


needs_onednn = pytest.mark.skipif(onednn_linear.LINEAR_POINTWISE is None,
                                  reason="no oneDNN linear here")


@pytest.fixture
def large_rows_onednn(monkeypatch):
    """oneDNN's products for many rows (``aiayn.onednn_linear.enabled``), on for one test whatever
    this CPU's default."""
    monkeypatch.setattr(onednn_linear, "enabled", True)


def test_onednn_default_follows_the_cpu():
    assert onednn_linear.enabled == onednn_linear.prefers_onednn()
    assert onednn_linear.prefers_onednn() == (
        onednn_linear.LINEAR_POINTWISE is not None
        and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))


def test_large_rows_onednn_switched_off_is_the_plain_layer(monkeypatch):
    monkeypatch.setattr(onednn_linear, "enabled", False)
    layer = nn.Linear(24, 40)
    x = torch.randn(2, onednn_linear.MIN_ROWS, 24)
    assert not inference_linear.uses_onednn(x, layer)
    with torch.no_grad():
        assert not inference_linear.uses_onednn(x, layer)
        assert inference_linear.linear_activation(layer, x, "gelu") is None


@needs_onednn
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_onednn_linear_with_fused_activation_equals_linear(activation, large_rows_onednn):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(2, onednn_linear.MIN_ROWS, 24)  # enough rows for the oneDNN path
    with torch.no_grad():
        assert inference_linear.uses_onednn(x, layer)
        fused = inference_linear.linear_activation(layer, x, activation)
        plain = activation_function(activation)(layer(x))
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(inference_linear.linear(layer, x), layer(x), rtol=1e-5, atol=1e-5)
        assert not inference_linear.uses_onednn(x[:, :3], layer)  # a few rows: the plain layer
    # under autograd the activation is not fused (its backward needs the product)
    assert inference_linear.linear_activation(layer, x, activation) is None


@needs_onednn
def test_models_with_onednn_inference_equal_the_plain_path(monkeypatch, large_rows_onednn):
    torch.manual_seed(0)
    encoder = TransformerEncoder(TransformerConfig.preset("tiny", activation="gelu")).eval()
    seq2seq = Transformer(TransformerConfig.preset("tiny")).eval()
    ids = torch.randint(3, 100, (6, 60))  # 360 rows: over MIN_ROWS
    mask = torch.ones(6, 60, dtype=torch.bool)
    mask[1, 40:] = False
    with torch.no_grad():
        fast = [encoder(ids, padding_mask=mask), seq2seq(ids, ids[:, :55], src_padding_mask=mask)]
        monkeypatch.setattr(onednn_linear, "enabled", False)
        plain = [encoder(ids, padding_mask=mask), seq2seq(ids, ids[:, :55], src_padding_mask=mask)]
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cross", [False, True])
def test_fused_projection_split_equals_permute_unbind(cross):
    """split + view (no copy in backward) == the view/permute/unbind formula, values and gradients."""
    import torch.nn.functional as F
    from aiayn.attention.kernels import FusedAttention
    from aiayn.attention.multihead import MultiHeadAttention

    torch.manual_seed(0)
    attention = MultiHeadAttention(16, 4, FusedAttention(), cross=cross)
    x = torch.randn(2, 5, 16, requires_grad=True)
    memory = torch.randn(2, 7, 16, requires_grad=True) if cross else None

    def heads(projected, parts):  # the former layout: (B, L, P, H, Dh) -> P x (B, H, L, Dh)
        batch, length, _ = projected.shape
        return projected.view(batch, length, parts, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)

    if cross:
        q = attention.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)
        k, v = heads(attention.kv_proj(memory), 2)
    else:
        q, k, v = heads(attention.qkv_proj(x), 3)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=not cross)
    expected = attention.out_proj(out.transpose(1, 2).reshape(2, 5, 16))
    inputs = [x] + ([memory] if cross else [])
    parameters = list(attention.parameters())
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs + parameters)
    got, _ = attention(x, memory, causal=not cross)
    got_grads = torch.autograd.grad(got.square().sum(), inputs + parameters)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for got_grad, expected_grad in zip(got_grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("rows", [1, 8, 300])  # one-row split, packed few rows, many rows
def test_feedforward_in_place_activation_at_inference_equals_autograd_path(activation, rows):
    """Without autograd the activation overwrites the product; values equal the recorded path's."""
    torch.manual_seed(0)
    feedforward = FeedForward(16, 48, activation=activation).eval()
    x = torch.randn(rows, 1, 16)
    expected = feedforward(x)  # autograd on: the out-of-place activation
    assert expected.requires_grad
    before = x.clone()
    with torch.no_grad():
        torch.testing.assert_close(feedforward(x), expected.detach(), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(feedforward(x), expected.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)  # the input is never overwritten


def test_feedforward_keeps_a_hooked_product_unchanged():
    """A forward hook on the first linear layer sees the product before the activation, at inference
    too (the in-place activation is skipped while a hook may hold the tensor)."""
    torch.manual_seed(0)
    feedforward = FeedForward(16, 48, activation="gelu").eval()
    seen = []
    handle = feedforward.linear1.register_forward_hook(lambda module, args, out: seen.append(out))
    x = torch.randn(300, 1, 16)
    with torch.no_grad():
        feedforward(x)
    handle.remove()
    torch.testing.assert_close(seen[0], feedforward.linear1(x).detach())


@pytest.mark.parametrize("norm_first", [False, True])
def test_residual_sum_into_the_sublayer_output_equals_the_plain_sum(norm_first, monkeypatch):
    """Without autograd the residual sums of many rows are written into the sub-layer's fresh
    output: the model's outputs are bitwise those of new-tensor sums (x + y and y + x round alike),
    and the layers' inputs are never overwritten."""
    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", norm_first=norm_first)
    model = Transformer(config).eval()
    src, tgt = torch.randint(3, 100, (2, 40)), torch.randint(3, 100, (2, 36))  # 80 / 72 rows
    assert layers.many_rows(torch.empty(2, 36, config.d_model))
    with torch.inference_mode():
        written_into = model(src, tgt)
        monkeypatch.setattr(layers, "owns_output", lambda sublayer, last: False)
        torch.testing.assert_close(written_into, model(src, tgt), rtol=0, atol=0)
    monkeypatch.undo()
    layer = model.encoder.layers[0]
    x = torch.randn(2, 40, config.d_model)
    before = x.clone()
    with torch.no_grad():
        layer(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("hooked", ["sublayer", "product", "global"])
def test_residual_sum_leaves_a_hooked_sublayer_output_unchanged(hooked):
    """A forward hook that keeps the attention's or the FFN's output sees it before the residual
    sum, at inference too (the sum then goes into a new tensor)."""
    torch.manual_seed(0)
    layer = Transformer(TransformerConfig.preset("tiny")).eval().encoder.layers[0]
    seen = []

    def keep(module, args, out):
        seen.append(out[0] if isinstance(out, tuple) else out)

    module = {"sublayer": layer.feedforward, "product": layer.feedforward.linear2}.get(hooked)
    handle = (module.register_forward_hook(keep) if module is not None
              else nn.modules.module.register_module_forward_hook(keep))
    x = torch.randn(2, 40, layer.feedforward.linear1.in_features)  # 80 rows: written in place
    try:
        with torch.no_grad():
            layer(x)
    finally:
        handle.remove()
    with torch.no_grad():
        attended = layer.attention_residual(x, lambda h: layer.self_attention(h)[0])
        expected = layer.feedforward(attended)
    if hooked == "global":  # every module's output: the FFN's must be among them, unchanged
        assert any(out.shape == expected.shape and torch.equal(out, expected) for out in seen)
    else:
        torch.testing.assert_close(seen[-1], expected, rtol=0, atol=0)
