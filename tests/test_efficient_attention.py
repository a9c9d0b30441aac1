"""Efficient kernels (chunked exact, linear, sparse) against their plain definitions.

chunked == reference; sparse == reference under the pattern's explicit dense mask (and == dense when the
window covers the sequence); linear == the masked quadratic formula of the same feature map; forward
and backward, with padding, right-aligned causal masks (fewer queries than keys) and empty rows.
"""

import pytest
import torch

from aiayn.nn.attention.chunked import ChunkedAttention
from aiayn.nn.attention.kernels import ReferenceAttention
from aiayn.nn.attention.linear import LinearAttention, feature_map
from aiayn.nn.attention.sparse import SparseAttention
from aiayn.masks import causal_mask

B, H, S, DH = 2, 3, 13, 8
TOLERANCES = [pytest.param(torch.float64, 1e-10, id="float64"),
              pytest.param(torch.float32, 1e-5, id="float32")]


def _inputs(dtype, query_length, key_length=S, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(B, H, query_length, DH), (B, H, key_length, DH), (B, H, key_length, DH)]
    return [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]


def _padding(key_length=S):
    padding = torch.ones(B, 1, 1, key_length, dtype=torch.bool)
    padding[0, ..., key_length - 4:] = False  # right padding
    padding[1, ..., :3] = False  # left padding (a left-padded prompt)
    return padding


def _run(kernel, q, k, v, **kwargs):
    out = kernel(q, k, v, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return out, grads


def _assert_same(got, expected, tolerance):
    (out, grads), (out_expected, grads_expected) = got, expected
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out, out_expected, atol=tolerance, rtol=tolerance)
    for grad, grad_expected in zip(grads, grads_expected):
        torch.testing.assert_close(grad, grad_expected, atol=tolerance, rtol=tolerance)


CASES = [pytest.param(S, False, id="bidirectional"), pytest.param(S, True, id="causal"),
         pytest.param(5, True, id="causal-5-queries"), pytest.param(1, True, id="causal-1-query")]


# --- chunked exact -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tolerance", TOLERANCES)
@pytest.mark.parametrize("query_length, causal", CASES)
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding"])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_equals_reference(dtype, tolerance, query_length, causal, padded, chunk):
    q, k, v = _inputs(dtype, query_length)
    mask = _padding() if padded else None
    expected = _run(ReferenceAttention(), q, k, v, mask=mask, causal=causal)
    _assert_same(_run(ChunkedAttention(chunk), q, k, v, mask=mask, causal=causal), expected,
                 tolerance)


def test_chunked_takes_dense_masks_and_empty_rows_give_zeros():
    q, k, v = _inputs(torch.float64, 6)
    mask = torch.rand(B, 1, 6, S, generator=torch.Generator().manual_seed(1)) > 0.5
    mask[0, 0, 2] = False  # a query with nothing to attend to
    mask[1, 0, 5] = False
    out, grads = _run(ChunkedAttention(4), q, k, v, mask=mask)
    _assert_same((out, grads), _run(ReferenceAttention(), q, k, v, mask=mask), 1e-10)
    assert out[0, :, 2].abs().max() == 0 and grads[0][0, :, 2].abs().max() == 0
    everything_padded = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    out, grads = _run(ChunkedAttention(4), q, k, v, mask=everything_padded, causal=True)
    assert out.abs().max() == 0 and all(g.abs().max() == 0 for g in grads)


# --- sparse --------------------------------------------------------------------------------------
def _pattern_mask(pattern, window, stride, query_length, key_length, causal):
    """The pattern of Child et al. 2019 as an explicit (T, S) boolean matrix (the slow definition)."""
    position = torch.arange(key_length - query_length, key_length)[:, None]  # right-aligned queries
    key = torch.arange(key_length)[None, :]
    distance = position - key
    local = distance.abs() < window
    strided = distance.remainder(stride) == 0
    allowed = {"local": local, "strided": strided, "local+strided": local | strided}[pattern]
    return allowed & (distance >= 0) if causal else allowed


@pytest.mark.parametrize("dtype, tolerance", TOLERANCES)
@pytest.mark.parametrize("query_length, causal", CASES)
@pytest.mark.parametrize("pattern", ["local", "local+strided"])
def test_sparse_with_window_covering_everything_equals_dense(dtype, tolerance, query_length, causal,
                                                             pattern):
    q, k, v = _inputs(dtype, query_length)
    mask = _padding()
    expected = _run(ReferenceAttention(), q, k, v, mask=mask, causal=causal)
    kernel = SparseAttention(pattern, window=S, stride=3)
    _assert_same(_run(kernel, q, k, v, mask=mask, causal=causal), expected, tolerance)


@pytest.mark.parametrize("query_length, causal", CASES)
@pytest.mark.parametrize("pattern, window, stride", [("local", 3, 1), ("local", 4, 1),
                                                     ("strided", 1, 3), ("strided", 1, 4),
                                                     ("local+strided", 3, 4),
                                                     ("local+strided", 4, 4),
                                                     ("local+strided", 5, 3)])
def test_sparse_equals_reference_under_the_pattern_mask(query_length, causal, pattern, window,
                                                         stride):
    q, k, v = _inputs(torch.float64, query_length)
    padding = _padding()
    dense = _pattern_mask(pattern, window, stride, query_length, S, causal) & padding
    expected = _run(ReferenceAttention(), q, k, v, mask=dense)
    kernel = SparseAttention(pattern, window=window, stride=stride)
    _assert_same(_run(kernel, q, k, v, mask=padding, causal=causal), expected, 1e-10)


def test_sparse_rows_without_keys_are_zero_and_dense_masks_are_refused():
    q, k, v = _inputs(torch.float32, S)
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[0, ..., :6] = False
    # Causal local window of 3: the first 6 queries of row 0 see only padded keys.
    out, grads = _run(SparseAttention("local", window=3, stride=4), q, k, v, mask=padding,
                      causal=True)
    assert torch.isfinite(out).all() and out[0, :, :6].abs().max() == 0
    assert grads[0][0, :, :6].abs().max() == 0 and torch.isfinite(grads[1]).all()
    with pytest.raises(ValueError, match="key masks only"):
        SparseAttention()(q, k, v, mask=torch.ones(B, 1, S, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="pattern must be one of"):
        SparseAttention("diagonal")
    with pytest.raises(ValueError, match="window must be a positive integer"):
        SparseAttention("local", window=0)


def test_sparse_never_scores_more_than_the_pattern_needs():
    """Block-sparse: scores per query are O(window + S / stride), not O(S)."""
    captured = []
    original = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        captured.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    q, k, v = (torch.randn(1, 2, 1024, 8) for _ in range(3))
    torch.Tensor.softmax = spy
    try:
        SparseAttention("local+strided", window=16, stride=32)(q, k, v, causal=True)
    finally:
        torch.Tensor.softmax = original
    (shape,) = captured
    assert shape == (1, 2, 1024, 16 + 15 + 1024 // 32)  # block + window - 1 local, S / stride strided


# --- linear --------------------------------------------------------------------------------------
def _linear_quadratic(q, k, v, mask, causal):
    """Katharopoulos et al. eq. 2 with sim(q, k) = phi(q) . phi(k), as a (T, S) matrix."""
    similarity = feature_map(q) @ feature_map(k).transpose(-2, -1)  # (B, H, T, S)
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if causal:
        allowed = causal_mask(q.shape[2], k.shape[2])
    if mask is not None:
        allowed = allowed & mask
    similarity = similarity * allowed
    denominator = similarity.sum(-1, keepdim=True)
    return torch.where(denominator > 0, similarity @ v / denominator.clamp_min(1e-30), 0.0)


@pytest.mark.parametrize("dtype, tolerance", TOLERANCES)
@pytest.mark.parametrize("query_length, causal", CASES)
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_linear_equals_quadratic_formula(dtype, tolerance, query_length, causal, chunk):
    q, k, v = _inputs(dtype, query_length)
    mask = _padding()
    expected = _run(lambda *a, **kw: _linear_quadratic(*a, **kw), q, k, v, mask=mask,
                    causal=causal)
    _assert_same(_run(LinearAttention(chunk), q, k, v, mask=mask, causal=causal), expected,
                 tolerance)


def test_linear_empty_rows_and_refusals():
    q, k, v = _inputs(torch.float32, S)
    padding = torch.ones(B, 1, 1, S, dtype=torch.bool)
    padding[0, ..., :4] = False
    out, grads = _run(LinearAttention(4), q, k, v, mask=padding, causal=True)
    assert out[0, :, :4].abs().max() == 0 and grads[0][0, :, :4].abs().max() == 0
    assert all(torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="key masks only"):
        LinearAttention()(q, k, v, mask=torch.ones(B, 1, S, S, dtype=torch.bool))
    with pytest.raises(ValueError, match="no attention weights to drop out"):
        LinearAttention()(q, k, v, dropout=0.1)
    with pytest.raises(ValueError, match="attention masks must be boolean"):
        LinearAttention()(q, k, v, mask=torch.ones(B, 1, 1, S))
