"""Derived weights of decoding steps (``aiayn.inference_linear.small_rows_linear``, issue 6).

- equal to ``F.linear`` for 1..64 rows (transposed copy for one row, oneDNN's packed weight for a
  vocabulary-sized output), with and without bias, and the whole output projection too;
- rebuilt whenever the weight changes: an optimizer step, ``load_state_dict``, ``copy_``, ``.data``
  assignment, ``.to()``; decoding right after a training step uses the new weights;
- greedy generation and beam search give the same tokens with the path switched off;
- entries go away with their weight; autograd and float64 never take the path.
"""
import gc

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn import inference_linear
from aiayn.decoding.beam import beam_search
from aiayn.decoding.sampling import generate

VOCAB = inference_linear.PACKED_MIN_OUTPUTS  # large enough for the packed path at 2..64 rows
needs_onednn = pytest.mark.skipif(inference_linear._REORDER is None,
                                  reason="no oneDNN packed linear here")


def _fast_and_plain(call, monkeypatch):
    with torch.no_grad():
        fast = call()
        monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
        plain = call()
        monkeypatch.setattr(inference_linear, "small_rows_enabled", True)
    return fast, plain


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64])
def test_small_rows_linear_equals_linear(rows, bias):
    torch.manual_seed(rows)
    weight = torch.randn(VOCAB, 48)
    b = torch.randn(VOCAB) if bias else None
    x = torch.randn(rows, 1, 48)  # (N, 1, I): a decoding step's shape
    with torch.no_grad():
        applies = inference_linear.uses_small_rows(x, weight)
        assert applies == (rows == 1 or inference_linear._REORDER is not None)
        if applies:
            out = inference_linear.small_rows_linear(x, weight, b)
            assert out.shape == (rows, 1, VOCAB) and out.is_contiguous()
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_small_rows_path_only_where_it_applies():
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    x = torch.randn(1, 16)
    assert not inference_linear.uses_small_rows(x, weight)  # autograd on
    with torch.no_grad():
        assert inference_linear.uses_small_rows(x, weight)
        assert not inference_linear.uses_small_rows(x.double(), weight.double())
        assert not inference_linear.uses_small_rows(torch.randn(65, 16), weight)  # too many rows
        small = torch.randn(100, 16)  # a layer-sized output: left to ``linear``
        assert not inference_linear.uses_small_rows(x, small)
        assert not inference_linear.uses_small_rows(torch.randn(4, 16), small)


def test_derived_weights_are_rebuilt_when_the_weight_changes():
    torch.manual_seed(0)
    layer = nn.Linear(24, VOCAB)
    x = torch.randn(4, 24)

    def check():
        for rows in (1, 4):
            with torch.no_grad():
                if inference_linear.uses_small_rows(x[:rows], layer.weight):
                    fast = inference_linear.small_rows_linear(x[:rows], layer.weight, layer.bias)
                    torch.testing.assert_close(fast, F.linear(x[:rows], layer.weight, layer.bias),
                                               rtol=1e-5, atol=1e-5)

    check()
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(x).square().mean().backward()
    optimizer.step()  # in place: the version counter moves
    check()
    layer.load_state_dict({"weight": torch.randn(VOCAB, 24), "bias": torch.randn(VOCAB)})
    check()
    with torch.no_grad():
        layer.weight.mul_(-1.0)
    check()
    layer.weight.data = torch.randn(VOCAB, 24)  # new storage under the same Parameter
    check()
    layer.to(torch.float64).to(torch.float32)  # new storage again
    check()


def test_entries_go_with_their_weight():
    weight = torch.randn(VOCAB, 8)
    before = len(inference_linear.packed_weights)
    with torch.no_grad():
        inference_linear.small_rows_linear(torch.randn(1, 8), weight, None)
    assert len(inference_linear.packed_weights) == before + 1
    del weight
    gc.collect()
    assert len(inference_linear.packed_weights) == before


def _lm() -> CausalLM:
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, norm_first=True, max_length=64)
    return CausalLM(config).eval()


def test_greedy_generation_equals_the_plain_path_after_a_training_step(monkeypatch):
    torch.manual_seed(0)
    model = _lm()
    prompts = torch.randint(1, VOCAB, (3, 5))
    for batch in (1, 3):  # one row: transposed copies; three rows: packed output projection

        def run():
            return generate(model, prompts[:batch], max_new_tokens=6, greedy=True).tokens

        fast, plain = _fast_and_plain(run, monkeypatch)
        assert fast == plain
    # a training step changes every weight in place; decoding must see the new ones
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model.train()
    ids = torch.randint(1, VOCAB, (2, 8))
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    model.eval()
    for batch in (1, 3):
        logits = lambda: model(prompts[:batch, :1])  # noqa: E731  (1 or 3 rows)
        fast, plain = _fast_and_plain(logits, monkeypatch)
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
        run = lambda: generate(model, prompts[:batch], max_new_tokens=6, greedy=True).tokens  # noqa
        fast, plain = _fast_and_plain(run, monkeypatch)
        assert fast == plain


def test_beam_search_equals_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, max_length=64)
    model = Transformer(config).eval()
    src = torch.randint(3, VOCAB, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    fast, plain = _fast_and_plain(lambda: beam_search(model, src, mask, beam_size=3, max_extra=5),
                                  monkeypatch)
    assert [h.tokens for h in fast] == [h.tokens for h in plain]
    torch.testing.assert_close(torch.tensor([h.score for h in fast]),
                               torch.tensor([h.score for h in plain]), rtol=1e-5, atol=1e-5)
