"""GPT-2's GELU through the sigmoid (aiayn.sigmoid_gelu) against x/2 (1 + tanh z) in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn import sigmoid_gelu
from aiayn.feedforward import FeedForward


def _reference(x: torch.Tensor) -> torch.Tensor:
    """x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in float64."""
    x = x.double()
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _inputs():
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=generator) * 4
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 11.0, -11.0, 12.0, -12.0, 30.0, -30.0])
    return torch.cat([spread, torch.linspace(-15, 15, 601), edges])


def test_forward_equals_the_tanh_form():
    x = _inputs()
    got = sigmoid_gelu.gelu_tanh(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    inplace = x.clone()
    assert sigmoid_gelu.gelu_tanh_(inplace) is inplace
    assert torch.equal(inplace, got)


def test_backward_equals_the_derivative_of_the_tanh_form():
    x = _inputs()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    leaf = x.clone().requires_grad_()
    sigmoid_gelu.gelu_tanh(leaf).backward(upstream)
    reference = x.double().requires_grad_()
    _reference(reference).backward(upstream.double())
    torch.testing.assert_close(leaf.grad.double(), reference.grad, rtol=1e-5, atol=1e-6)
    plain = x.clone().requires_grad_()
    F.gelu(plain, approximate="tanh").backward(upstream)
    torch.testing.assert_close(leaf.grad, plain.grad, rtol=1e-5, atol=1e-5)


def test_huge_and_infinite_inputs_give_the_limits_not_nan():
    # F.gelu's backward gives NaN for |x| >= ~1e19; the limits are 1 (x -> inf) and 0 (x -> -inf).
    x = torch.tensor([1e19, -1e19, 1e30, -1e30, 3e38, -3e38, float("inf")], requires_grad=True)
    out = sigmoid_gelu.gelu_tanh(x)
    out.backward(torch.ones_like(out))
    assert torch.equal(out.detach()[[0, 2, 4, 6]], x.detach()[[0, 2, 4, 6]])
    assert torch.equal(out.detach()[[1, 3, 5]].abs(), torch.zeros(3))
    assert x.grad.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert torch.isnan(sigmoid_gelu.gelu_tanh(torch.tensor([float("nan")]))).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_keep_torchs_gelu(dtype):
    x = _inputs().to(dtype)
    assert not sigmoid_gelu.applies(x)
    assert torch.equal(sigmoid_gelu.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    assert torch.equal(sigmoid_gelu.gelu_tanh_(x.clone()), F.gelu(x, approximate="tanh"))


def test_the_feed_forward_network_trains_and_infers_through_it(monkeypatch):
    torch.manual_seed(0)
    ffn = FeedForward(8, 32, activation="gelu_tanh")
    x = torch.randn(2, 5, 8)
    calls = []
    real = sigmoid_gelu._sigmoid_2z
    monkeypatch.setattr(sigmoid_gelu, "_sigmoid_2z", lambda t: calls.append(t.shape) or real(t))
    ffn(x).square().sum().backward()
    assert calls == [(2, 5, 32), (2, 5, 32)]  # forward, and the backward's recomputation
    got = {name: p.grad.clone() for name, p in ffn.named_parameters()}
    ffn.zero_grad()
    monkeypatch.setattr(ffn, "activation", lambda t: F.gelu(t, approximate="tanh"))
    ffn(x).square().sum().backward()
    for name, p in ffn.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        ffn.activation_in_place(ffn.linear1(x))
    assert len(calls) == 3


def test_torch_compile_traces_it_whole():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(sigmoid_gelu.gelu_tanh, backend="aot_eager", fullgraph=True)
    x = _inputs()
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    leaves = [x.clone().requires_grad_() for _ in range(2)]
    outputs = [compiled(leaves[0]), sigmoid_gelu.gelu_tanh(leaves[1])]
    for out in outputs:
        out.backward(upstream)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, rtol=1e-6, atol=1e-7)
    assert not counters["graph_break"]


def test_functorch_transforms_keep_torchs_gelu():
    """``torch.func.grad`` / ``vmap`` work as with ``F.gelu`` (the autograd.Function has no functorch
    rules) and give its values."""
    x = _inputs()[:64]
    got = torch.func.grad(lambda t: sigmoid_gelu.gelu_tanh(t).sum())(x)
    want = torch.func.grad(lambda t: F.gelu(t, approximate="tanh").sum())(x)
    assert torch.equal(got, want)
    rows = x.view(8, 8)
    assert torch.equal(torch.func.vmap(sigmoid_gelu.gelu_tanh)(rows), F.gelu(rows, approximate="tanh"))
