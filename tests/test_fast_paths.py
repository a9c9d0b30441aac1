"""The speed-motivated shortcuts of the core (issue 6) compute exactly what the plain path computes.

- inactive dropout (eval mode, or p = 0) is skipped instead of called: outputs equal a model whose
  dropout modules are called explicitly; active dropout still drops;
- the KV cache writes and reads through ``narrow`` views: equal to slice assignment.
"""

import torch
from torch import nn

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn.attention.cache import KVCache
from aiayn.feedforward import FeedForward
from aiayn.layers import Residual


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
