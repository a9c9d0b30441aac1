"""Derived weights of decoding steps (``aiayn.inference_linear.small_rows_linear``, issue 6).

- equal to ``F.linear`` for 1..64 rows (transposed copy for one row, oneDNN's packed weight for a
  vocabulary-sized output), with and without bias, and the whole output projection too;
- the layers' own weights packed at 2..64 rows (``linear``, ``linear_activation``) equal ``nn.Linear``
  (+ activation), and only there (one row, 65 rows, autograd, float64 and the switches keep the plain path);
- rebuilt whenever the weight changes: an optimizer step, ``load_state_dict``, ``copy_``, ``.data``
  assignment, ``.to()``; decoding right after a training step uses the new weights;
- greedy generation and beam search give the same tokens with the path switched off;
- where no copy is made (copies switched off, inference tensors), steps of 2..64 rows go through
  oneDNN on the weight as it is (``uses_uncopied_step``), equal to ``F.linear`` (+ activation), and
  only there; the output projection from 16 rows; decoding gives the same tokens that way (on by
  default only where PyTorch runs AVX-512 kernels; switched on here for every CPU);
- entries go away with their weight; autograd and float64 never take the path.
"""
import gc
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn import inference_linear
from aiayn.decoding.beam import beam_search
from aiayn.decoding.sampling import generate
from thread_helpers import threads

VOCAB = inference_linear.PACKED_MIN_OUTPUTS  # large enough for the packed path at 2..64 rows
needs_onednn = pytest.mark.skipif(inference_linear._REORDER is None,
                                  reason="no oneDNN packed linear here")
needs_pointwise = pytest.mark.skipif(inference_linear._LINEAR_POINTWISE is None,
                                     reason="no oneDNN linear here")


@pytest.fixture(autouse=True)
def uncopied_steps_on(monkeypatch):
    """The uncopied oneDNN steps on, as on AVX-512 CPUs, so their tests run on any CPU."""
    monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", True)


def test_uncopied_steps_default_follows_the_cpu():
    # a fresh interpreter: this module's fixture has switched the path on here
    code = ("from aiayn import inference_linear, onednn_linear; "
            "print(inference_linear.uncopied_steps_enabled, onednn_linear.prefers_onednn())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    default, prefers = result.stdout.split()
    assert default == prefers


SWITCHES = ("small_rows_enabled", "split_gemv_enabled", "split_rows_enabled",
            "uncopied_steps_enabled")


def _fast_and_plain(call, monkeypatch, *, keep: tuple[str, ...] = ()):
    """``call()`` with every fast path of this module, then with all but ``keep`` switched off."""
    with torch.no_grad():
        fast = call()
        for switch in SWITCHES:
            monkeypatch.setattr(inference_linear, switch, switch in keep)
        plain = call()
        for switch in SWITCHES:
            monkeypatch.setattr(inference_linear, switch, True)
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
    gc.collect()  # weights of earlier tests left in reference cycles would go during the count
    before = len(inference_linear.packed_weights)
    rows = 2 if inference_linear._REORDER is not None else 1  # 1 row may split instead of copying
    with torch.no_grad(), threads(1):
        inference_linear.small_rows_linear(torch.randn(rows, 8), weight, None)
    assert len(inference_linear.packed_weights) == before + 1
    del weight
    gc.collect()
    assert len(inference_linear.packed_weights) == before


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1, 40), (1, 40), (40,)])
def test_split_gemv_equals_linear(shape, parts, bias):
    torch.manual_seed(parts)
    weight, b = torch.randn(96, 40), (torch.randn(96) if bias else None)
    x = torch.randn(shape)
    with torch.no_grad():
        out = inference_linear.split_gemv(x, weight, b, parts)
    assert out.shape == (*shape[:-1], 96)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_split_gemv_only_where_it_applies(monkeypatch):
    weight, row = torch.randn(96, 40), torch.randn(1, 40)
    with torch.no_grad():
        with threads(2):
            assert inference_linear.split_gemv_parts(row, weight) == 2
            assert inference_linear.split_gemv_parts(torch.randn(2, 40), weight) == 1  # not one row
            assert inference_linear.split_gemv_parts(row.double(), weight.double()) == 1
            assert inference_linear.split_gemv_parts(row, torch.randn(95, 40)) == 1  # 2 does not divide
            monkeypatch.setattr(inference_linear, "split_gemv_enabled", False)
            assert inference_linear.split_gemv_parts(row, weight) == 1
            monkeypatch.setattr(inference_linear, "split_gemv_enabled", True)
        with threads(3):
            assert inference_linear.split_gemv_parts(row, weight) == 3
        with threads(1):
            assert inference_linear.split_gemv_parts(row, weight) == 1  # nothing to split across
    with threads(2):
        assert inference_linear.split_gemv_parts(row, weight) == 1  # autograd on
        layer = nn.Linear(40, 96)
        with torch.no_grad():  # through ``linear`` and the FFN's activation path
            torch.testing.assert_close(inference_linear.linear(layer, row), layer(row))


@needs_onednn
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("rows", [2, 7, 16, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_layer_equals_linear(rows, activation, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(40, 72, bias=bias)
    x = torch.randn(rows, 1, 40)  # (N, 1, I): a decoding step of N rows
    plain = {None: lambda h: h, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
             "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}[activation](layer(x))
    entries = len(inference_linear.packed_weights)
    with torch.no_grad():
        assert inference_linear.uses_packed_layer(x, layer)
        out = (inference_linear.linear(layer, x) if activation is None
               else inference_linear.linear_activation(layer, x, activation))
    assert len(inference_linear.packed_weights) == entries + 1  # one derived copy, made here
    assert out.shape == (rows, 1, 72)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


def test_packed_layer_only_where_it_applies(monkeypatch):
    layer = nn.Linear(16, 32)
    x = torch.randn(4, 16)
    assert not inference_linear.uses_packed_layer(x, layer)  # autograd on
    with torch.no_grad():
        assert inference_linear.uses_packed_layer(x, layer) == (inference_linear._REORDER is not None)
        assert not inference_linear.uses_packed_layer(torch.randn(1, 16), layer)  # one row: GEMV
        assert not inference_linear.uses_packed_layer(torch.randn(65, 16), layer)  # not a step
        assert not inference_linear.uses_packed_layer(torch.randn(1, 8, 16), layer)  # a prefill
        assert inference_linear.uses_packed_layer(torch.randn(8, 1, 16), layer) == (
            inference_linear._REORDER is not None)  # a step of 8 rows
        assert not inference_linear.uses_packed_layer(x.double(), layer.double())
        monkeypatch.setattr(inference_linear, "packed_layers_enabled", False)
        assert not inference_linear.uses_packed_layer(x, layer.float())
        monkeypatch.setattr(inference_linear, "packed_layers_enabled", True)
        monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
        assert not inference_linear.uses_packed_layer(x, layer)
        monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", False)
        assert inference_linear.linear_activation(layer, x, "relu") is None  # caller's plain path


def test_weights_made_under_inference_mode_get_no_copy():
    # Inference tensors have no version counter, so a derived copy could go stale unseen.
    with torch.inference_mode():
        layer, head = nn.Linear(16, 32), torch.randn(VOCAB, 16)
        x = torch.randn(4, 16)
        assert not inference_linear.uses_packed_layer(x, layer)
        assert not inference_linear.uses_small_rows(x, head)
        assert inference_linear.uses_uncopied_step(x, layer.weight) == (
            inference_linear._LINEAR_POINTWISE is not None)
        entries = len(inference_linear.packed_weights)
        torch.testing.assert_close(inference_linear.linear(layer, x), layer(x),
                                   rtol=1e-5, atol=1e-5)
        assert len(inference_linear.packed_weights) == entries
        model = _lm()  # a whole model made and used under inference_mode decodes as usual
        tokens = generate(model, torch.randint(1, VOCAB, (2, 3)), max_new_tokens=3, greedy=True)
        assert len(tokens.tokens) == 2


def _lm() -> CausalLM:
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, norm_first=True, max_length=64)
    return CausalLM(config).eval()


def test_greedy_generation_equals_the_plain_path_after_a_training_step(monkeypatch):
    torch.manual_seed(0)
    model = _lm()
    prompts = torch.randint(1, VOCAB, (3, 5))
    _check_decoding(model, prompts, monkeypatch)
    # a training step changes every weight in place; decoding must see the new ones. The fused
    # AdamW (the trainer's choice on CPU) does not move the weights' version counters.
    for fused in (False, True):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=fused)
        model.train()
        ids = torch.randint(1, VOCAB, (2, 8))
        F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
        model.eval()
        _check_decoding(model, prompts, monkeypatch)


def _check_decoding(model, prompts, monkeypatch):
    # one row: split products (2 threads) or transposed copies (1 thread); three rows: packed weights
    for batch, count in ((1, 1), (1, 2), (3, 2)):
        with threads(count):
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


# --- no copies: oneDNN on the weight as it is -----------------------------------------------------
@needs_pointwise
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("rows", [2, 7, 16, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_uncopied_step_equals_linear(rows, activation, bias, monkeypatch):
    monkeypatch.setattr(inference_linear, "small_rows_enabled", False)  # no copies
    torch.manual_seed(rows)
    layer = nn.Linear(40, 72, bias=bias)
    x = torch.randn(rows, 1, 40)
    plain = {None: lambda h: h, "relu": F.relu, "gelu": F.gelu, "silu": F.silu}[activation](layer(x))
    calls = []
    pointwise = inference_linear._LINEAR_POINTWISE
    monkeypatch.setattr(inference_linear, "_LINEAR_POINTWISE",
                        lambda *args: calls.append(args[1]) or pointwise(*args))
    entries = len(inference_linear.packed_weights)
    with torch.no_grad():
        assert inference_linear.uses_uncopied_step(x, layer.weight)
        assert not inference_linear.uses_packed_layer(x, layer)
        out = (inference_linear.linear(layer, x) if activation is None
               else inference_linear.linear_activation(layer, x, activation))
    assert len(inference_linear.packed_weights) == entries  # nothing derived
    assert len(calls) == 1 and calls[0] is layer.weight  # oneDNN on the weight itself
    assert out.shape == (rows, 1, 72)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


def test_uncopied_step_only_where_it_applies(monkeypatch):
    weight = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(4, 16)
    assert not inference_linear.uses_uncopied_step(x, weight)  # autograd on
    with torch.no_grad():
        assert inference_linear.uses_uncopied_step(x, weight) == (
            inference_linear._LINEAR_POINTWISE is not None)
        assert not inference_linear.uses_uncopied_step(torch.randn(1, 16), weight)  # one row
        assert not inference_linear.uses_uncopied_step(torch.randn(65, 16), weight)  # not a step
        assert not inference_linear.uses_uncopied_step(torch.randn(1, 8, 16), weight)  # a prefill
        assert not inference_linear.uses_uncopied_step(x.double(), weight.double())
        monkeypatch.setattr(inference_linear, "uncopied_steps_enabled", False)
        assert not inference_linear.uses_uncopied_step(x, weight)
        monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
        layer = nn.Linear(16, 32)
        assert inference_linear.linear_activation(layer, x, "relu") is None  # caller's plain path


@needs_pointwise
@pytest.mark.parametrize("rows", [2, 8, 16, 64])
def test_output_projection_without_copies(rows, monkeypatch):
    from aiayn.models.heads import OutputProjection
    monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
    torch.manual_seed(rows)
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, output_bias=True)
    head = OutputProjection(config, nn.Embedding(VOCAB, 24), tied=True)
    with torch.no_grad():
        head.bias.normal_()
    hidden = torch.randn(rows, 1, 24)
    calls = []
    uncopied = inference_linear.uncopied_step_linear
    monkeypatch.setattr(inference_linear, "uncopied_step_linear",
                        lambda *args: calls.append(rows) or uncopied(*args))
    with torch.no_grad():
        out = head(hidden)
    # oneDNN from UNCOPIED_MIN_ROWS rows; below, the vocabulary-major product
    assert len(calls) == (rows >= OutputProjection.UNCOPIED_MIN_ROWS)
    assert out.shape == (rows, 1, VOCAB) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(hidden, head.weight, head.bias), rtol=1e-5, atol=1e-5)


@needs_pointwise
def test_decoding_without_copies_equals_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    lm = _lm()
    prompts = torch.randint(1, VOCAB, (16, 5))  # 16 rows: the output projection's uncopied path too
    monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
    for batch in (3, 16):
        run = lambda: generate(lm, prompts[:batch], max_new_tokens=6, greedy=True).tokens  # noqa
        uncopied, plain = _fast_and_plain(run, monkeypatch, keep=("uncopied_steps_enabled",))
        monkeypatch.setattr(inference_linear, "small_rows_enabled", False)
        assert uncopied == plain
    config = TransformerConfig.preset("tiny", vocab_size=VOCAB, max_length=64)
    model = Transformer(config).eval()
    src = torch.randint(3, VOCAB, (4, 6))
    uncopied, plain = _fast_and_plain(
        lambda: beam_search(model, src, torch.ones(4, 6, dtype=torch.bool), beam_size=4, max_extra=5),
        monkeypatch, keep=("uncopied_steps_enabled",))
    assert [h.tokens for h in uncopied] == [h.tokens for h in plain]
