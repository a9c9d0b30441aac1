"""Fused kernel == reference kernel, forward and backward, under every mask; no NaN anywhere; an
explicit score scale (``attention_scale``) in every exact kernel == softmax(q k^T * s) v by hand."""

import math

import pytest
import torch

from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention
from aiayn.masks import causal_mask

B, H, T, S, DH = 2, 3, 5, 7, 8


def _inputs(dtype, query_length=T, key_length=S):
    q = torch.randn(B, H, query_length, DH, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, key_length, DH, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, key_length, DH, dtype=dtype, requires_grad=True)
    return q, k, v


def _masks():
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[0, ..., 4:] = False
    full_row = torch.ones(B, 1, T, S, dtype=torch.bool)
    full_row[1, 0, 2] = False  # one query of batch 1 sees nothing
    everything_padded = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    return {"none": (None, False), "padding": (padding, False), "causal": (None, True),
            "padding+causal": (padding, True), "fully masked row": (full_row, False),
            "all keys padded": (everything_padded, True)}


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", list(_masks()))
def test_fused_equals_reference_forward_and_backward(dtype, tolerance, case):
    mask, causal = _masks()[case]
    q, k, v = _inputs(dtype)
    reference = ReferenceAttention()(q, k, v, mask=mask, causal=causal)
    grads_reference = torch.autograd.grad(reference.square().sum(), (q, k, v))
    fused = FusedAttention()(q, k, v, mask=mask, causal=causal)
    grads_fused = torch.autograd.grad(fused.square().sum(), (q, k, v))
    assert torch.isfinite(fused).all() and torch.isfinite(reference).all()
    torch.testing.assert_close(fused, reference, atol=tolerance, rtol=tolerance)
    for fused_grad, reference_grad in zip(grads_fused, grads_reference):
        assert torch.isfinite(fused_grad).all()
        torch.testing.assert_close(fused_grad, reference_grad, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", [ReferenceAttention(), FusedAttention()])
def test_fully_masked_rows_are_zero_with_zero_gradient(kernel):
    q, k, v = _inputs(torch.float32)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = kernel(q, k, v, mask=mask)
    assert out[0, :, 1].abs().max() == 0
    out.sum().backward()
    assert q.grad[0, :, 1].abs().max() == 0
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_reference_is_equation_one_and_returns_weights():
    q, k, v = _inputs(torch.float64)
    out, weights = ReferenceAttention().with_weights(q, k, v)
    expected_weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DH), dim=-1)
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(out, expected_weights @ v)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T, dtype=torch.float64))


def test_causal_flag_is_right_aligned_when_queries_are_fewer():
    q, k, v = _inputs(torch.float64, query_length=3, key_length=6)
    flag = ReferenceAttention()(q, k, v, causal=True)
    explicit = ReferenceAttention()(q, k, v, mask=causal_mask(3, 6))
    torch.testing.assert_close(flag, explicit)
    fused = FusedAttention()(q, k, v, causal=True)
    torch.testing.assert_close(fused, explicit)
    # The last query sits at the last position and sees every key.
    full = ReferenceAttention()(q[:, :, -1:], k, v)
    torch.testing.assert_close(flag[:, :, -1:], full)


def test_attention_dropout_is_applied_only_when_asked():
    q, k, v = _inputs(torch.float32, T, S)
    base = FusedAttention()(q, k, v)
    torch.testing.assert_close(FusedAttention()(q, k, v, dropout=0.0), base)
    assert not torch.allclose(ReferenceAttention()(q, k, v, dropout=0.5), base)


def test_swap_exact_kernels_changes_the_kernel_not_the_model():
    from aiayn import SequenceClassifier, TransformerConfig
    from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention, swap_exact_kernels

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", vocab_size=50, num_labels=3, attention="fused")
    model = SequenceClassifier(config).eval()
    ids = torch.randint(3, 50, (4, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1:, 6:] = False
    before = model(ids, padding_mask=mask)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert swap_exact_kernels(model, "reference") == config.n_encoder_layers
    assert all(type(m.kernel) is ReferenceAttention for m in model.modules() if hasattr(m, "kernel"))
    torch.testing.assert_close(model(ids, padding_mask=mask), before, rtol=1e-5, atol=1e-6)
    assert model.state_dict().keys() == state.keys()
    swap_exact_kernels(model, "fused")
    assert all(type(m.kernel) is FusedAttention for m in model.modules() if hasattr(m, "kernel"))
    with pytest.raises(ValueError, match="between 'reference' and 'fused'"):
        swap_exact_kernels(model, "linear")


SCALE = 0.7  # far from the default 1 / sqrt(DH) = 0.35


def _scaled_kernels():
    from aiayn.nn.attention.chunked import ChunkedAttention
    from aiayn.nn.attention.sparse import SparseAttention

    # sparse with a local window wider than the keys attends to every key: exact
    return {"reference": ReferenceAttention(SCALE), "fused": FusedAttention(SCALE),
            "chunked": ChunkedAttention(3, scale=SCALE),
            "sparse": SparseAttention("local", window=64, scale=SCALE)}


@pytest.mark.parametrize("case", ["none", "padding", "causal", "padding+causal"])
@pytest.mark.parametrize("name", list(_scaled_kernels()))
def test_an_explicit_scale_multiplies_the_scores_in_every_exact_kernel(name, case):
    """softmax(q k^T * s) v written out, forward and backward, with T < S (right-aligned causal)."""
    mask, causal = _masks()[case]
    q, k, v = _inputs(torch.float64)
    allowed = torch.ones(B, 1, T, S, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask
    if causal:
        allowed = allowed & causal_mask(T, S)
    weights = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~allowed, -math.inf).softmax(-1)
    want = weights @ v
    got = _scaled_kernels()[name](q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(got, want)
    for grad, want_grad in zip(torch.autograd.grad(got.square().sum(), (q, k, v)),
                               torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(grad, want_grad)
    default = type(_scaled_kernels()[name])(**({"window": 64} if name == "sparse" else {}))
    assert (default(q, k, v, mask=mask, causal=causal) - want).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["reference", "fused", "chunked", "sparse"])
def test_every_softmax_kernel_built_from_a_config_takes_its_attention_scale(attention):
    from aiayn import TransformerConfig
    from aiayn.nn.attention.kernels import make_kernel

    config = TransformerConfig.preset("tiny", attention=attention, attention_scale=SCALE)
    assert make_kernel(config).scale == SCALE
    assert make_kernel(config, cross=True).scale == SCALE
    assert make_kernel(config.replace(attention_scale=None)).scale is None
    assert make_kernel(config.replace(attention_scale=None, scale_attention=False)).scale == 1.0
