"""Attention through batched products (aiayn.attention.gemm_attention) against eq. 1 written out."""

from __future__ import annotations

import pytest
import torch

from aiayn import TransformerConfig
from aiayn.attention import gemm_attention
from aiayn.attention.kernels import FusedAttention, ReferenceAttention
from aiayn.models import CausalLM, Transformer

from training_helpers import step_gradients


def _qkv(batch=2, heads=3, queries=11, keys=11, width=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, width, generator=generator, dtype=dtype)
    k = torch.randn(batch, heads, keys, width, generator=generator, dtype=dtype)
    v = torch.randn(batch, heads, keys, width, generator=generator, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _output_and_grads(attend, inputs, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = attend(*leaves)
    out.backward(upstream)
    return out.detach(), [leaf.grad for leaf in leaves]


# Queries 11 with blocks of 4: three blocks, the last partial; 8: two exact blocks; 3: one block.
@pytest.mark.parametrize("queries", [3, 8, 11])
@pytest.mark.parametrize("causal", [False, True])
def test_output_and_gradients_equal_the_reference(monkeypatch, queries, causal):
    monkeypatch.setattr(gemm_attention, "BLOCK", 4)
    inputs = _qkv(queries=queries, keys=queries if causal else 5)
    upstream = torch.randn(inputs[0].shape, dtype=inputs[0].dtype)
    got = _output_and_grads(lambda q, k, v: gemm_attention.attention(q, k, v, causal=causal),
                            inputs, upstream)
    want = _output_and_grads(lambda q, k, v: ReferenceAttention()(q, k, v, causal=causal),
                             inputs, upstream)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    for grad, expected in zip(got[1], want[1]):
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_strided_views_of_a_fused_projection_give_the_same_results(monkeypatch):
    """q, k, v as the model makes them: views into one (B, T, 3, H, Dh) projection."""
    monkeypatch.setattr(gemm_attention, "BLOCK", 4)
    qkv = torch.randn(2, 10, 3, 3, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    grads = []
    for attend in (gemm_attention.attention, ReferenceAttention()):
        qkv.grad = None
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = attend(q, k, v, causal=True)
        out.backward(upstream)
        grads.append((out.detach(), qkv.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-10, atol=1e-12)


def test_a_future_key_or_value_changes_nothing_before_it(monkeypatch):
    monkeypatch.setattr(gemm_attention, "BLOCK", 4)
    q, k, v = (t.detach() for t in _qkv(queries=10, keys=10))
    before = gemm_attention.attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] += 5.0
    v2[:, :, 6:] -= 3.0
    after = gemm_attention.attention(q, k2, v2, causal=True)
    assert torch.equal(before[:, :, :6], after[:, :, :6])
    assert not torch.allclose(before[:, :, 6:], after[:, :, 6:])


@pytest.fixture
def small_calls(monkeypatch):
    """The test shapes are far below MIN_SCORES and MIN_KEYS_UNMASKED: let them through."""
    monkeypatch.setattr(gemm_attention, "MIN_SCORES", 1)
    monkeypatch.setattr(gemm_attention, "MIN_KEYS_UNMASKED", 1)


def test_applies_only_to_float32_cpu_training_without_dropout_or_too_many_keys(monkeypatch):
    q, k, v = _qkv(dtype=torch.float32)
    assert not gemm_attention.applies(q, k, v, 0.0)  # 2 x 3 x 11 x 11 scores: too small a call
    monkeypatch.setattr(gemm_attention, "MIN_SCORES", 2 * 3 * 11 * 11)
    assert not gemm_attention.applies(q, k, v, 0.0)  # 11 keys, no mask: SDPA's unmasked kernel
    assert gemm_attention.applies(q, k, v, 0.0, masked=True)
    monkeypatch.setattr(gemm_attention, "MIN_KEYS_UNMASKED", 11)
    assert gemm_attention.applies(q, k, v, 0.0)
    assert not gemm_attention.applies(q, k, v, 0.1)  # dropout on the weights: the fused kernel's
    assert not gemm_attention.applies(*_qkv(), 0.0)  # float64
    with torch.no_grad():  # inference: nothing to keep P for
        assert not gemm_attention.applies(q, k, v, 0.0)
    assert not gemm_attention.applies(*(t.detach() for t in (q, k, v)), 0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm_attention.applies(q, k, v, 0.0)
    long_k, long_v = (torch.randn(2, 3, gemm_attention.MAX_KEYS + 1, 8) for _ in range(2))
    assert not gemm_attention.applies(q, long_k, long_v, 0.0)
    monkeypatch.setattr(gemm_attention, "enabled", False)
    assert not gemm_attention.applies(q, k, v, 0.0)


def test_functorch_transforms_keep_the_fused_kernel(small_calls):
    """``torch.func.grad`` through the fused kernel works as before (the autograd.Function has no
    functorch rules) and gives the reference gradient."""
    q, k, v = (t.detach().float() for t in _qkv())

    def loss(query, kernel):
        return kernel(query, k, v, causal=True).square().sum()

    got = torch.func.grad(loss)(q, FusedAttention())
    want = torch.func.grad(loss)(q, ReferenceAttention())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_bad_mask_names_the_problem():
    q, k, v = (t.detach() for t in _qkv(queries=5, keys=6))
    with pytest.raises(ValueError, match="boolean mask broadcastable"):
        gemm_attention.attention(q, k, v, mask=torch.ones(2, 1, 1, 6))  # float
    with pytest.raises(ValueError, match="boolean mask broadcastable"):
        gemm_attention.attention(q, k, v, mask=torch.ones(2, 1, 1, 7, dtype=torch.bool))


@pytest.mark.parametrize("shapes, causal, message", [
    (((2, 3, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8)), True, "as many queries as keys"),
    (((2, 3, 5, 8), (2, 3, 6, 4), (2, 3, 6, 4)), False, r"expected q \(B, H, T, Dh\)"),
    (((2, 3, 5, 8), (2, 3, 6, 8), (2, 3, 7, 8)), False, r"expected q \(B, H, T, Dh\)"),
    (((3, 5, 8), (3, 6, 8), (3, 6, 8)), False, r"expected q \(B, H, T, Dh\)"),
])
def test_bad_shapes_name_the_problem(shapes, causal, message):
    q, k, v = (torch.randn(shape) for shape in shapes)
    with pytest.raises(ValueError, match=message):
        gemm_attention.attention(q, k, v, causal=causal)


def test_the_fused_kernel_uses_it_in_training_only(small_calls, monkeypatch):
    calls = []
    real = gemm_attention.attention
    monkeypatch.setattr(gemm_attention, "attention",
                        lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs))
    q, k, v = _qkv(dtype=torch.float32)
    kernel = FusedAttention()
    kernel(q, k, v, causal=True)
    kernel(q, k[:, :, :7], v[:, :, :7])  # cross-attention shapes, no mask
    assert calls == [{"causal": True, "mask": None}, {"causal": False, "mask": None}]
    with torch.no_grad():
        kernel(q, k, v, causal=True)
    assert len(calls) == 2
    kernel(q, k, v, dropout=0.1)  # dropout on the weights: SDPA's
    assert len(calls) == 2
    padding = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    kernel(q, k, v, mask=padding, causal=True)
    kernel(q[:, :, -3:], k, v, causal=True)  # 3 queries at the end: right-aligned causal as a mask
    assert calls[2]["causal"] and calls[2]["mask"] is padding
    assert not calls[3]["causal"] and calls[3]["mask"].shape == (3, 11)


def _padding(lengths, keys, *, left=False):
    positions = torch.arange(keys)
    rows = [(positions >= keys - n) if left else (positions < n) for n in lengths]
    return torch.stack(rows)[:, None, None, :]  # (B, 1, 1, S)


@pytest.mark.parametrize("case", ["keys padded", "left padded causal", "full mask", "2-d mask",
                                  "a row with no key"])
def test_masked_output_and_gradients_equal_the_reference(monkeypatch, case):
    monkeypatch.setattr(gemm_attention, "BLOCK", 4)
    causal = case in ("left padded causal", "2-d mask")
    queries, keys = (11, 11) if causal else (7, 11)
    inputs = _qkv(queries=queries, keys=keys)
    if case == "keys padded":
        mask = _padding([11, 6], keys)
    elif case == "left padded causal":  # queries before the first real key see nothing at all
        mask = _padding([11, 5], keys, left=True)
    elif case == "full mask":
        mask = torch.rand(2, 3, queries, keys, generator=torch.Generator().manual_seed(1)) < 0.6
    elif case == "2-d mask":
        mask = torch.rand(queries, keys, generator=torch.Generator().manual_seed(2)) < 0.7
    else:
        mask = _padding([11, 6], keys).expand(2, 1, queries, keys).clone()
        mask[1, 0, 3] = False  # query 3 of the second sequence: no key
    upstream = torch.randn(inputs[0].shape, dtype=inputs[0].dtype)
    got = _output_and_grads(
        lambda q, k, v: gemm_attention.attention(q, k, v, causal=causal, mask=mask), inputs, upstream)
    want = _output_and_grads(
        lambda q, k, v: ReferenceAttention()(q, k, v, mask=mask, causal=causal), inputs, upstream)
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    for grad, expected in zip(got[1], want[1]):
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    if case == "a row with no key":
        assert not got[0][1, :, 3].any() and not got[1][0][1, :, 3].any()


def test_padded_keys_and_values_change_nothing(monkeypatch):
    monkeypatch.setattr(gemm_attention, "BLOCK", 4)
    q, k, v = (t.detach() for t in _qkv(queries=9, keys=9))
    mask = _padding([9, 5], 9)
    before = gemm_attention.attention(q, k, v, causal=True, mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 5:] = 1e3
    v2[1, :, 5:] = -1e3
    after = gemm_attention.attention(q, k2, v2, causal=True, mask=mask)
    assert torch.equal(before[:, :, :5], after[:, :, :5]) and torch.equal(before[0], after[0])


@pytest.mark.parametrize("kind", ["lm", "translation"])
def test_a_training_step_equals_the_one_through_the_fused_kernel(small_calls, monkeypatch, kind):
    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny")
    tokens = torch.randint(3, config.vocab_size, (2, 9))
    if kind == "lm":
        model = CausalLM(config).train()
        run = lambda m: m(tokens).logsumexp(-1).mean()  # noqa: E731
    else:
        model = Transformer(config).train()
        source = torch.randint(3, config.vocab_size, (2, 7))
        run = lambda m: m(source, tokens).logsumexp(-1).mean()  # noqa: E731
    monkeypatch.setattr(gemm_attention, "BLOCK", 4)
    calls = []
    real = gemm_attention.attention
    monkeypatch.setattr(gemm_attention, "attention",
                        lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs))
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(gemm_attention, "enabled", enabled)
        results.append(step_gradients(model, run))
    # Every layer's self-attention (and cross-attention) went through it, and only when enabled.
    layers = (config.n_decoder_layers if kind == "lm"
              else config.n_encoder_layers + 2 * config.n_decoder_layers)
    assert len(calls) == layers
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert results[1][1].keys() == results[0][1].keys()
    for name, grad in results[1][1].items():
        torch.testing.assert_close(grad, results[0][1][name], rtol=1e-4, atol=1e-6)


def test_a_compiled_layer_runs_it_between_its_graphs(small_calls, monkeypatch):
    """Under ``torch.compile`` the call is a graph break (the products run eagerly between the
    compiled graphs); the compiled step equals the eager one. aot_eager: Dynamo's capture and AOT
    autograd without C++ code generation, so the test stays short."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0)
    eager = CausalLM(config).train()
    compiled = CausalLM(config).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.decoder.layers[0].compile(backend="aot_eager")
    forwards = []
    real_forward = gemm_attention._GemmAttention.forward
    monkeypatch.setattr(gemm_attention._GemmAttention, "forward", staticmethod(
        lambda ctx, *args: forwards.append(1) or real_forward(ctx, *args)))
    tokens = torch.randint(3, config.vocab_size, (2, 9))
    run = lambda m: m(tokens).logsumexp(-1).mean()  # noqa: E731
    want = step_gradients(eager, run)
    torch._dynamo.reset()
    counters.clear()
    forwards.clear()
    got = step_gradients(compiled, run)
    assert len(forwards) == config.n_decoder_layers  # the compiled layer's attention too
    breaks = list(counters["graph_break"])  # distinct reasons (Dynamo counts its restarts too)
    assert len(breaks) == 1 and "`attention`" in breaks[0]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for name, grad in got[1].items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-4, atol=1e-6)
    # Switched off (or in inference, on a GPU, ...) the fused kernel is traced: no graph break.
    monkeypatch.setattr(gemm_attention, "enabled", False)
    torch._dynamo.reset()
    counters.clear()
    forwards.clear()
    step_gradients(compiled, run)
    assert not forwards and not counters["graph_break"]


def test_importing_aiayn_does_not_import_dynamo():
    """``attention_between_graphs`` imports Dynamo on its first call, not at import (which doubled
    ``import aiayn``'s time)."""
    import subprocess
    import sys

    code = "import sys, aiayn.models, aiayn.training; print('torch._dynamo' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
