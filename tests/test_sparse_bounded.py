"""Sparse attention with a bounded strided reach (``stride_count``; a dilated sliding window, Beltagy et
al. 2020) against its plain definition: ReferenceAttention under the pattern's explicit (T, S) mask built
by position arithmetic; forward and gradients, causal and bidirectional, right-aligned queries (T < S),
key padding, lengths that are not multiples of the stride, cached decoding, and the block-sparse
promise that no (T, S) or (Aq, Ak) tensor is ever formed.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn import TransformerConfig
from aiayn.nn.attention.kernels import ReferenceAttention, make_kernel
from aiayn.nn.attention import sparse
from aiayn.nn.attention.sparse import SparseAttention, sparse_attention

B, H, DH = 2, 3, 8


def _inputs(query_length, key_length, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(B, H, query_length, DH), (B, H, key_length, DH), (B, H, key_length, DH)]
    return [torch.randn(shape, generator=generator, dtype=dtype).requires_grad_() for shape in shapes]


def _padding(key_length):
    padding = torch.ones(B, 1, 1, key_length, dtype=torch.bool)
    padding[0, ..., key_length - 4:] = False  # right padding
    padding[1, ..., :3] = False  # left padding (a left-padded prompt)
    return padding


def _pattern_mask(pattern, window, stride, count, query_length, key_length, causal):
    """The bounded pattern as an explicit (T, S) boolean matrix (the slow definition)."""
    position = torch.arange(key_length - query_length, key_length)[:, None]  # right-aligned queries
    distance = position - torch.arange(key_length)[None, :]  # (T, S)
    local = distance.abs() < window
    strided = (distance.remainder(stride) == 0) & (distance.abs() <= count * stride)
    allowed = {"local": local, "strided": strided, "local+strided": local | strided}[pattern]
    return allowed & (distance >= 0) if causal else allowed


def _run(kernel, q, k, v, **kwargs):
    out = kernel(q, k, v, **kwargs)
    return out, torch.autograd.grad(out.square().sum(), (q, k, v))


def _assert_same(got, expected, tolerance=1e-10):
    (out, grads), (out_expected, grads_expected) = got, expected
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out, out_expected, atol=tolerance, rtol=tolerance)
    for grad, grad_expected in zip(grads, grads_expected):
        torch.testing.assert_close(grad, grad_expected, atol=tolerance, rtol=tolerance)


# (T, S, causal): S = 13 and 17 are not multiples of any stride used; T < S is the decoding case.
CASES = [pytest.param(13, 13, False, id="bidirectional"), pytest.param(17, 17, True, id="causal"),
         pytest.param(5, 17, True, id="causal-5-of-17"), pytest.param(1, 13, True, id="causal-1-query"),
         pytest.param(5, 13, False, id="bidirectional-5-of-13")]
# (pattern, window, stride, count): every count * stride < S - 1, so a bounded path runs: with more
# queries than the stride the row windows or the masked column grid (``layout``), with at most
# ``stride`` queries by gathering (decoding).
PATTERNS = [("strided", 1, 3, 1), ("strided", 1, 2, 3), ("local+strided", 3, 4, 1),
            ("local+strided", 5, 3, 2), ("local+strided", 4, 4, 2), ("local+strided", 2, 2, 4),
            ("local", 3, 2, 1), ("strided", 1, 5, 2), ("local+strided", 2, 6, 1)]


@pytest.fixture(params=["row-windows", "column-grid"])
def layout(request, monkeypatch):
    """Forces one of the two layouts of the bounded strided keys (chosen by column length)."""
    monkeypatch.setattr(sparse, "COLUMN_GRID_ROWS_PER_COUNT", 0 if request.param == "row-windows"
                        else 10 ** 6)
    return request.param


@pytest.mark.parametrize("query_length, key_length, causal", CASES)
@pytest.mark.parametrize("pattern, window, stride, count", PATTERNS)
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding"])
def test_bounded_sparse_equals_reference_under_the_pattern_mask(query_length, key_length, causal,
                                                                pattern, window, stride, count,
                                                                padded, layout):
    q, k, v = _inputs(query_length, key_length)
    padding = _padding(key_length) if padded else None
    dense = _pattern_mask(pattern, window, stride, count, query_length, key_length, causal)
    expected = _run(ReferenceAttention(), q, k, v, mask=dense if padding is None else dense & padding)
    kernel = SparseAttention(pattern, window=window, stride=stride, stride_count=count)
    _assert_same(_run(kernel, q, k, v, mask=padding, causal=causal), expected)


def test_bounded_sparse_in_float32(layout):
    q, k, v = _inputs(17, 17, dtype=torch.float32)
    dense = _pattern_mask("local+strided", 3, 4, 2, 17, 17, True)
    _assert_same(_run(SparseAttention("local+strided", 3, 4, 2), q, k, v, causal=True),
                 _run(ReferenceAttention(), q, k, v, mask=dense), tolerance=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("pattern", ["strided", "local+strided"])
def test_a_reach_covering_the_sequence_is_the_unbounded_pattern_exactly(causal, pattern):
    q, k, v = _inputs(17, 17)
    padding = _padding(17)
    unbounded = SparseAttention(pattern, window=3, stride=4)(q, k, v, mask=padding, causal=causal)
    for count in (4, 5, 100):  # 4 * 4 = 16 = S - 1: the farthest key is within reach
        bounded = SparseAttention(pattern, window=3, stride=4, stride_count=count)
        assert torch.equal(bounded(q, k, v, mask=padding, causal=causal), unbounded)
    # One stride less is a different pattern: the bound really bounds.
    bounded = SparseAttention(pattern, window=3, stride=4, stride_count=3)
    assert not torch.allclose(bounded(q, k, v, mask=padding, causal=causal), unbounded)


def test_rows_without_keys_are_zero():
    q, k, v = _inputs(17, 17, dtype=torch.float32)
    padding = torch.ones(B, 1, 1, 17, dtype=torch.bool)
    padding[0, ..., :12] = False
    # Causal strided keys 0 and 3 back (stride 3, count 1): queries 0..11 of row 0 see only padding.
    out, grads = _run(SparseAttention("strided", window=1, stride=3, stride_count=1), q, k, v,
                      mask=padding, causal=True)
    assert torch.isfinite(out).all() and out[0, :, :12].abs().max() == 0
    assert out[0, :, 12:].abs().min() > 0
    assert grads[0][0, :, :12].abs().max() == 0 and torch.isfinite(grads[1]).all()


def test_dropout_acts_on_the_bounded_weights():
    q, k, v = _inputs(17, 17, dtype=torch.float32)
    kernel = SparseAttention("local+strided", window=3, stride=4, stride_count=2)
    plain = kernel(q, k, v, causal=True)
    torch.manual_seed(0)
    dropped = kernel(q, k, v, causal=True, dropout=0.5)
    torch.manual_seed(0)
    assert torch.equal(kernel(q, k, v, causal=True, dropout=0.5), dropped)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, plain)
    # The first query sees only itself: its one weight (1.0) is either dropped (0) or doubled (2.0).
    first = dropped[:, :, 0] / v[:, :, 0]
    assert all(torch.allclose(row, torch.zeros_like(row)) or torch.allclose(row, torch.full_like(row, 2.0))
               for row in first.reshape(-1, DH))


@pytest.mark.parametrize("pattern", ["strided", "local+strided"])
def test_cached_decoding_token_by_token_equals_the_full_forward(pattern, layout):
    q, k, v = _inputs(19, 19)
    padding = _padding(19)
    kernel = SparseAttention(pattern, window=3, stride=3, stride_count=2)
    full = kernel(q, k, v, mask=padding, causal=True)
    cache = kernel.new_cache(B, H, 19, DH, dtype=torch.float64)
    steps = [kernel.decode(q[:, :, :7], k[:, :, :7], v[:, :, :7], cache, 0, mask=padding[..., :7])]
    for t in range(7, 19):  # one token at a time, the cache growing past the reach 2 * 3
        steps.append(kernel.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache, t,
                                   mask=padding[..., :t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=2), full, atol=1e-12, rtol=1e-12)


def test_a_decoded_token_scores_only_its_window_and_its_strided_keys():
    captured = []
    original = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        captured.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1000, 8)
    torch.Tensor.softmax = spy
    try:
        sparse_attention(q, k, k, causal=True, window=16, stride=32, stride_count=4)
    finally:
        torch.Tensor.softmax = original
    assert captured == [(1, 2, 1, 16 + 4 + 1)]  # the window; 0..4 strides back (0 masked: local)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_bounded_kernel_never_forms_a_quadratic_tensor(causal):
    """Forward and backward: no intermediate as large as the unbounded (Aq, Ak) grid or (T, S)."""
    n, stride = 4096, 16
    q, k, v = (torch.randn(1, 1, n, 4, requires_grad=True) for _ in range(3))
    sizes = {}
    for count in (None, 2):
        with _LargestTensor() as spy:
            out = sparse_attention(q, k, v, causal=causal, pattern="local+strided", window=8,
                                   stride=stride, stride_count=count)
            out.square().sum().backward()
        sizes[count] = spy.largest
    grid = n * n // stride  # l * Aq * Ak scores of the unbounded strided part
    assert sizes[None] >= grid  # the spy sees the unbounded kernel's quadratic grid...
    # ...and the bounded one nothing above its per-query windows: a query block's local keys
    # (block + 2 (window - 1), block = window) plus its strided rows (3 blocks of count rows).
    assert sizes[2] <= n * (3 * 8 + 3 * 2) < grid // 8


def test_the_bound_is_a_config_field_wired_to_the_kernel(tmp_path):
    config = TransformerConfig.preset("tiny", attention="sparse", attention_window=3,
                                      attention_stride=4, attention_stride_count=2)
    kernel = make_kernel(config)
    assert (kernel.pattern, kernel.window, kernel.stride, kernel.stride_count) == (
        "local+strided", 3, 4, 2)
    assert "stride_count=2" in repr(kernel)
    assert make_kernel(config.replace(attention_stride_count=None)).stride_count is None
    assert TransformerConfig().attention_stride_count is None  # default: Child et al.'s pattern
    assert TransformerConfig.from_dict(config.to_dict()) == config
    config.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json") == config
    unbounded = config.replace(attention_stride_count=None)
    unbounded.save(tmp_path / "unbounded.json")
    assert TransformerConfig.load(tmp_path / "unbounded.json").attention_stride_count is None


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_bad_bounds_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="attention_stride_count must be a positive integer or None"):
        TransformerConfig.preset("tiny", attention="sparse", attention_stride_count=value)
    with pytest.raises(ValueError, match="stride_count must be a positive integer or None"):
        SparseAttention("local+strided", stride_count=value)
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="stride_count must be a positive integer or None"):
        sparse_attention(q, q, q, stride_count=value)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_per_head_key_masks(causal, layout):
    q, k, v = _inputs(17, 17)
    mask = torch.rand(B, H, 1, 17, generator=torch.Generator().manual_seed(3)) > 0.3  # (B, H, 1, S)
    dense = _pattern_mask("local+strided", 3, 4, 2, 17, 17, causal)
    _assert_same(_run(SparseAttention("local+strided", 3, 4, 2), q, k, v, mask=mask, causal=causal),
                 _run(ReferenceAttention(), q, k, v, mask=dense & mask))
