"""Decoding steps of 2..8 rows without derived weight copies: the weight, as it is, split across the
threads (``aiayn.inference_linear.split_rows``, issue 6).

- equal to ``F.linear`` for 2..8 rows of any leading shape, with and without bias, in 2..4 parts;
- taken only where it applies: no autograd, CPU float32 without autocast, 2..8 rows, a thread count
  that divides the output width, the switch on; and by ``linear`` only where no copy is made and
  oneDNN's uncopied products are off (as where PyTorch runs AVX2 kernels): copies switched off, or
  the weights of inference tensors;
- the output projection takes it at 6..12 rows (the vocabulary-major product below and above);
- greedy generation and beam search give the plain path's tokens through it.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn import inference_linear
from aiayn.decoding.beam import beam_search
from aiayn.decoding.sampling import generate
from thread_helpers import threads
from aiayn.feedforward import FeedForward
from aiayn.models.heads import OutputProjection

VOCAB = inference_linear.PACKED_MIN_OUTPUTS  # vocabulary-sized: the output projection's few-row paths


@pytest.fixture
def no_copies(monkeypatch):
    """Copies switched off and oneDNN's uncopied products off: what reaches the split path."""
    monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
    monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", False)


def _spy(monkeypatch) -> list[int]:
    """Rows of every ``split_rows`` call from now on."""
    calls, split = [], inference_linear.split_rows
    monkeypatch.setattr(inference_linear, "split_rows",
                        lambda x, *rest: calls.append(x.numel() // x.shape[-1]) or split(x, *rest))
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("shape", [(2, 40), (5, 1, 40), (8, 40), (2, 3, 40), (1, 7, 40)])
def test_split_rows_equals_linear(shape, parts, bias):
    torch.manual_seed(parts)
    weight, b = torch.randn(96, 40), (torch.randn(96) if bias else None)
    x = torch.randn(shape)
    with torch.no_grad():
        out = inference_linear.split_rows(x, weight, b, parts)
    assert out.shape == (*shape[:-1], 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_split_rows_only_where_it_applies(monkeypatch):
    weight, rows = torch.randn(96, 40), torch.randn(4, 1, 40)
    parts = inference_linear.split_rows_parts
    with torch.no_grad():
        with threads(2):
            assert parts(rows, weight) == 2
            assert parts(torch.randn(8, 40), weight) == 2
            assert parts(torch.randn(1, 40), weight) == 1  # one row: split_gemv's
            assert parts(torch.randn(9, 40), weight) == 1  # past SPLIT_ROWS_MAX
            assert parts(torch.randn(12, 40), weight, max_rows=12) == 2
            assert parts(rows.double(), weight.double()) == 1
            assert parts(rows, torch.randn(95, 40)) == 1  # 2 does not divide 95
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert parts(rows, weight) == 1
            monkeypatch.setattr(inference_linear, "split_rows_enabled", False)
            assert parts(rows, weight) == 1
            monkeypatch.setattr(inference_linear, "split_rows_enabled", True)
        with threads(3):
            assert parts(rows, weight) == 3
        with threads(1):
            assert parts(rows, weight) == 1  # nothing to split across
    with threads(2):
        assert parts(rows, weight) == 1  # autograd on


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_layers_without_copies_take_it_and_equal_the_plain_layers(activation, no_copies,
                                                                  monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(40, 96)
    feedforward = FeedForward(40, 96, activation=activation, dropout=0.0).eval()
    calls = _spy(monkeypatch)
    x = torch.randn(6, 1, 40)
    with torch.no_grad(), threads(2):
        out = inference_linear.linear(layer, x)
        assert calls == [6]
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)
        # the FFN's activation is applied by its own plain code after the split product
        assert inference_linear.linear_activation(feedforward.linear1, x, activation) is None
        got = feedforward(x)
        assert calls == [6, 6, 6]  # both FFN products
        monkeypatch.setattr(inference_linear, "split_rows_enabled", False)
        expected = feedforward(x)
        inference_linear.linear(layer, torch.randn(6, 40))
    assert calls == [6, 6, 6]  # switched off: not taken
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(inference_linear._REORDER is None or inference_linear._LINEAR_POINTWISE is None,
                    reason="no oneDNN here")
def test_copies_and_uncopied_onednn_come_first(monkeypatch):
    layer = nn.Linear(40, 96)
    calls = _spy(monkeypatch)
    x = torch.randn(4, 1, 40)
    with torch.no_grad(), threads(2):
        monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", False)
        inference_linear.linear(layer, x)  # the packed copy
        monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
        monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", True)
        inference_linear.linear(layer, x)  # oneDNN on the weight as it is (AVX-512's default)
    assert calls == []


def test_weights_made_under_inference_mode_take_it(monkeypatch):
    monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", False)
    with torch.inference_mode():
        layer = nn.Linear(40, 96)  # an inference tensor: never copied
        x = torch.randn(3, 1, 40)
        calls = _spy(monkeypatch)
        with threads(2):
            out = inference_linear.linear(layer, x)
    assert calls == [3]
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [2, 5, 6, 8, 12, 13])
def test_output_projection_at_6_to_12_rows(rows, no_copies, monkeypatch):
    torch.manual_seed(rows)
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, output_bias=True)
    head = OutputProjection(config, nn.Embedding(VOCAB, 24), tied=True)
    with torch.no_grad():
        head.bias.normal_()
    hidden = torch.randn(rows, 1, 24)
    calls = _spy(monkeypatch)
    with torch.no_grad(), threads(2):
        out = head(hidden)
    low, high = OutputProjection.SPLIT_ROWS
    assert calls == ([rows] if low <= rows <= high else [])
    assert out.shape == (rows, 1, VOCAB) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(hidden, head.weight, head.bias), rtol=1e-5, atol=1e-5)


def test_decoding_through_it_gives_the_plain_tokens(no_copies, monkeypatch):
    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, norm_first=True, max_length=64)
    lm = CausalLM(config).eval()
    prompts = torch.randint(1, VOCAB, (8, 5))
    model = Transformer(TransformerConfig.preset("tiny", vocab_size=VOCAB, max_length=64)).eval()
    src = torch.randint(3, VOCAB, (2, 6))  # 2 sources x 4 beams: 8 rows a step
    mask = torch.ones(2, 6, dtype=torch.bool)
    calls = _spy(monkeypatch)

    def decode():
        with threads(2):
            tokens = generate(lm, prompts, max_new_tokens=6, greedy=True).tokens
            hypotheses = beam_search(model, src, mask, beam_size=4, max_extra=5)
        return tokens, [h.tokens for h in hypotheses], [h.score for h in hypotheses]

    split = decode()
    assert 8 in calls
    monkeypatch.setattr(inference_linear, "split_rows_enabled", False)
    plain = decode()
    assert split[:2] == plain[:2]
    torch.testing.assert_close(torch.tensor(split[2]), torch.tensor(plain[2]), rtol=1e-5, atol=1e-5)
