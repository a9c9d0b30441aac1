"""Large float32 products through oneDNN (``aiayn.onednn_linear``, issue 6) compute what MKL computes.

- ``linear``: output and the gradients of input, weight and bias equal ``F.linear``'s, for (N, I) and
  (B, T, I) inputs, with and without bias, whichever inputs require a gradient;
- ``applies``: only at MIN_ROWS rows and more, CPU float32, plain tensors, no autocast, and only
  while switched on;
- ``torch.compile`` keeps the custom operators in its graph (no break) and an inductor-compiled
  layer trains like the eager one;
- the layers' ``inference_linear.linear`` takes it under autograd, except for a layer with a hook (which
  must still fire);
- the chunked loss and whole training steps (encoder-decoder, decoder-only, encoder classifier): the
  same loss and gradients with the path on and off.
"""
import pytest

import torch
import torch.nn.functional as F
from torch import nn

from aiayn import CausalLM, SequenceClassifier, Transformer, TransformerConfig
from aiayn import inference_linear, onednn_linear
from aiayn.tasks.lm import token_loss
from aiayn.tasks.translation import translation_loss
from aiayn.training.linear_cross_entropy import linear_cross_entropy

from training_helpers import step_gradients

pytestmark = pytest.mark.skipif(onednn_linear.LINEAR_POINTWISE is None, reason="no oneDNN linear here")

ROWS = onednn_linear.MIN_ROWS


@pytest.fixture
def onednn_on(monkeypatch):
    monkeypatch.setattr(onednn_linear, "enabled", True)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


@pytest.mark.parametrize("shape", [(ROWS, 24), (2, ROWS // 2 + 3, 24)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("needs", ["all", "input", "weight"])
def test_linear_equals_f_linear_with_gradients(shape, bias, needs, onednn_on):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=needs in ("all", "input"))
    weight = torch.randn(40, 24, requires_grad=needs in ("all", "weight"))
    b = torch.randn(40, requires_grad=needs == "all") if bias else None
    assert onednn_linear.applies(x, weight)
    ours = _leaves(x, weight, *([b] if bias else []))
    plain = _leaves(x, weight, *([b] if bias else []))
    out = onednn_linear.linear(ours[0], ours[1], ours[2] if bias else None)
    expected = F.linear(plain[0], plain[1], plain[2] if bias else None)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # a non-contiguous upstream gradient, as a split or transpose downstream produces
    grad = torch.randn(*shape[:-1], 80)[..., ::2]
    out.backward(grad)
    expected.backward(grad)
    for a, b_ in zip(ours, plain):
        assert (a.grad is None) == (b_.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b_.grad, rtol=1e-4, atol=1e-4)


def test_applies_only_where_it_should(monkeypatch, onednn_on):
    weight = torch.randn(40, 24)
    x = torch.randn(ROWS, 24)
    assert onednn_linear.applies(x, weight)
    assert not onednn_linear.applies(x[: ROWS - 1], weight)  # too few rows
    assert not onednn_linear.applies(x.double(), weight.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not onednn_linear.applies(x, weight)

    class Subclass(torch.Tensor):  # stands for FSDP's DTensor parameters
        pass

    assert not onednn_linear.applies(x, weight.as_subclass(Subclass))
    monkeypatch.setattr(onednn_linear, "enabled", False)
    assert not onednn_linear.applies(x, weight)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's imports (torch.jit)
def test_compiled_graphs_keep_the_onednn_operators(onednn_on):
    """``torch.compile`` traces the custom operators whole (no graph break) with their autograd."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(2, ROWS, 24, requires_grad=True)
    counts = {"aiayn.onednn_linear": 0}

    def backend(graph, example_inputs):
        counts["aiayn.onednn_linear"] += sum("onednn_linear" in str(node.target)
                                             for node in graph.graph.nodes)
        return graph.forward

    compiled = torch.compile(lambda x: inference_linear.linear(layer, x).relu().sum(),
                             backend=backend, fullgraph=True)
    loss = compiled(x)
    assert counts["aiayn.onednn_linear"] == 1
    loss.backward()
    expected = x.detach().clone().requires_grad_()
    reference = layer(expected).relu().sum()
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(x.grad, expected.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # inductor generates and compiles C++ (tens of seconds)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_inductor_compiled_layer_trains_like_eager(onednn_on):
    from aiayn.layers import EncoderLayer

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", dropout=0.0, activation="gelu")
    layer = EncoderLayer(config)
    x = torch.randn(4, ROWS // 4, config.d_model, requires_grad=True)
    eager_out = layer(x)[0]
    eager_out.square().sum().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    compiled = torch.compile(layer)
    out = compiled(x)[0]
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_layers_take_it_under_autograd_unless_hooked(monkeypatch, onednn_on):
    torch.manual_seed(0)
    layer = nn.Linear(24, 40)
    x = torch.randn(2, ROWS, 24, requires_grad=True)
    calls = []
    real = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear", lambda *a: calls.append(1) or real(*a))
    out = inference_linear.linear(layer, x)
    assert calls == [1]
    torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)
    seen = []
    handle = layer.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    inference_linear.linear(layer, x)
    handle.remove()
    assert calls == [1] and seen == [(2, ROWS, 40)]  # the hooked layer ran as a module


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_equal_on_and_off(monkeypatch, bias):
    torch.manual_seed(0)
    hidden = torch.randn(700, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    b = torch.randn(300, requires_grad=True) if bias else None
    targets = torch.randint(0, 300, (700,))
    targets[::7] = -100
    results = []
    for on in (True, False):
        monkeypatch.setattr(onednn_linear, "enabled", on)
        leaves = _leaves(hidden, weight, *([b] if bias else []))
        loss = linear_cross_entropy(leaves[0], leaves[1], targets, bias=leaves[2] if bias else None,
                                    smoothing=0.1, chunk=512)  # a 512-row and a 188-row chunk
        loss.backward()
        results.append([loss] + [t.grad for t in leaves])
    for a, b_ in zip(*results):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["seq2seq", "lm", "classifier"])
def test_training_step_equal_on_and_off(monkeypatch, family):
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (6, 65))  # 6 x 64 = 384 rows: over MIN_ROWS
    if family == "seq2seq":
        model = Transformer(TransformerConfig.preset("tiny", dropout=0.0))
        loss_of = lambda m: translation_loss(m, ids[:, :50], ids[:, :-1], ids[:, 1:], smoothing=0.1)
    elif family == "lm":
        model = CausalLM(TransformerConfig.preset("tiny", dropout=0.0, norm_first=True,
                                                  positions="learned"))
        loss_of = lambda m: token_loss(m, ids[:, :-1], ids[:, 1:])
    else:
        model = SequenceClassifier(TransformerConfig.preset("tiny", dropout=0.0, num_labels=3))
        labels = torch.tensor([0, 1, 2, 0, 1, 2])
        loss_of = lambda m: F.cross_entropy(m(ids[:, :64]), labels)
    calls = []
    real = onednn_linear.linear
    monkeypatch.setattr(onednn_linear, "linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(onednn_linear, "enabled", True)
    fast = step_gradients(model, loss_of)
    assert calls, "the oneDNN path was not taken"
    monkeypatch.setattr(onednn_linear, "enabled", False)
    plain = step_gradients(model, loss_of)
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    assert fast[1].keys() == plain[1].keys()
    for name in plain[1]:
        torch.testing.assert_close(fast[1][name], plain[1][name], rtol=1e-4, atol=1e-5, msg=name)
