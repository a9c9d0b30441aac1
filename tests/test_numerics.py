"""Numerics: no NaN/inf forward or backward for fully masked rows, all-padding batches of length 1,
extreme logits, and bf16/fp16 autocast on every attention kernel and every model family, and the
autocast result close to float32 (loose tolerance), not merely finite.

CPU autocast runs matmuls in bf16 / fp16 (both supported on CPU by torch >= 2.4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aiayn import TransformerConfig
from aiayn.nn.attention.kernels import KERNELS
from aiayn.models import CausalLM, SequenceClassifier, Transformer
from aiayn.training import label_smoothed_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Loose: bf16 keeps 8 mantissa bits (~3 significant digits), fp16 11.
TOLERANCE = {"bf16": 0.1, "fp16": 0.02}
# GELU, not ReLU: a ReLU input near 0 may flip sign under fp16 rounding and move a whole gradient row,
# which says nothing about padding or kernels (what these tests are about).
BASE = TransformerConfig.preset("tiny", vocab_size=30, num_labels=3, dropout=0.0, activation="gelu",
                                attention_window=4, attention_stride=4, attention_chunk_size=4)


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def kernel(name: str):
    return KERNELS[name].build(BASE.replace(attention=name))


def qkv(batch=3, heads=2, length=8, head_dim=4, scale=1.0):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, heads, length, head_dim, generator=generator) * scale)
            .requires_grad_() for _ in range(3)]


def padding_with_an_empty_row(batch: int, length: int) -> torch.Tensor:
    """(B, S) True = real token: row 0 full, row 1 all padding, row 2 half padded."""
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1] = False
    mask[2, length // 2:] = False
    return mask


# --- kernels --------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_under_autocast_is_finite_close_to_float32_and_zero_on_masked_rows(name, dtype,
                                                                                   causal):
    attention = kernel(name)
    q, k, v = qkv()
    mask = padding_with_an_empty_row(3, 8)[:, None, None, :]  # (B, 1, 1, S)
    expected = attention(q, k, v, mask=mask, causal=causal)
    expected.sum().backward()
    expected_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with torch.autocast("cpu", dtype=DTYPES[dtype]):
        out = attention(q, k, v, mask=mask, causal=causal)
    out.float().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    assert all_finite([out, *grads])
    assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))  # no key: zeros
    assert all(torch.equal(g[1], torch.zeros_like(g[1])) for g in grads)  # and no gradient
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=2 * TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_on_half_inputs_with_a_length_1_all_padding_batch(name, dtype):
    """q/k/v stored in bf16/fp16 (no autocast); one key, masked for every row."""
    attention = kernel(name)
    q, k, v = [t.detach().to(DTYPES[dtype]).requires_grad_() for t in qkv(length=1)]
    for causal in (False, True):
        mask = torch.zeros(3, 1, 1, 1, dtype=torch.bool)
        out = attention(q, k, v, mask=mask, causal=causal)
        out.float().sum().backward()
        assert out.dtype == DTYPES[dtype] and out.shape == (3, 2, 1, 4)
        assert torch.equal(out, torch.zeros_like(out))
        assert all_finite([t.grad for t in (q, k, v)])


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_with_extreme_scores_saturates_without_nan(name):
    """Scores of size ~1e4 (fp32 and bf16): the softmax becomes one-hot, never inf - inf."""
    attention = kernel(name)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = [t.detach().to(dtype).requires_grad_() for t in qkv(scale=50.0)]
        mask = padding_with_an_empty_row(3, 8)[:, None, None, :]
        out = attention(q, k, v, mask=mask, causal=True)
        out.float().sum().backward()
        assert all_finite([out, q.grad, k.grad, v.grad]), (name, dtype)


# --- model families -------------------------------------------------------------------------------
FAMILIES = ("encoder-decoder", "causal-lm", "classifier")


def family_loss(family: str, model, ids, padding):
    """The training loss of each family (label smoothing on the token families, as in training)."""
    if family == "encoder-decoder":
        logits = model(ids, ids, src_padding_mask=padding, tgt_padding_mask=padding)
    elif family == "causal-lm":
        logits = model(ids, padding_mask=padding)
    else:
        logits = model(ids, padding_mask=padding)
        return logits, F.cross_entropy(logits.float(), torch.arange(len(ids)) % 3)
    return logits, label_smoothed_cross_entropy(logits.flatten(0, 1), ids.flatten(),
                                                smoothing=0.1, ignore_index=0)


def build(family: str, config: TransformerConfig):
    torch.manual_seed(0)
    return {"encoder-decoder": Transformer, "causal-lm": CausalLM,
            "classifier": SequenceClassifier}[family](config)


def forward_backward(family, model, ids, padding, dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits, loss = family_loss(family, model, ids, padding)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float(), loss.detach().float(), grads


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(KERNELS))
@pytest.mark.parametrize("family", FAMILIES)
def test_model_under_autocast_with_an_all_padding_row(family, name, dtype, one_thread):
    """Every family x kernel x dtype: a batch with a full, an all-padding and a half-padded row;
    logits, loss and every gradient finite, and close to the float32 run."""
    model = build(family, BASE.replace(attention=name))
    ids = torch.randint(3, 30, (3, 6), generator=torch.Generator().manual_seed(1))
    padding = padding_with_an_empty_row(3, 6)
    ids = ids.masked_fill(~padding, 0)
    want_logits, want_loss, want_grads = forward_backward(family, model, ids, padding)
    logits, loss, grads = forward_backward(family, model, ids, padding, DTYPES[dtype])
    assert all_finite([logits, loss, *grads.values()])
    assert set(grads) == set(want_grads)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(logits, want_logits, atol=3 * tolerance, rtol=tolerance)
    torch.testing.assert_close(loss, want_loss, atol=0, rtol=tolerance)
    # Gradients: loose, relative to each tensor's own scale (elementwise fp16/bf16 noise).
    for key, grad in grads.items():
        scale = want_grads[key].abs().max().clamp(min=1e-3)
        assert (grad - want_grads[key]).abs().max() <= 5 * tolerance * scale, key


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("family, pooling", [(family, "first") for family in FAMILIES]
                         + [("classifier", "mean")])  # mean pooling over no token at all
def test_all_padding_batch_of_length_1(family, norm_first, pooling, one_thread):
    """Every row is one padding token: nothing to attend to anywhere; still finite (fp32, bf16)."""
    model = build(family, BASE.replace(norm_first=norm_first, pooling=pooling))
    ids = torch.zeros(2, 1, dtype=torch.long)
    padding = torch.zeros(2, 1, dtype=torch.bool)
    for dtype in (None, torch.bfloat16):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            if family == "encoder-decoder":
                logits = model(ids, ids, src_padding_mask=padding, tgt_padding_mask=padding)
            else:
                logits = model(ids, padding_mask=padding)
        logits.float().sum().backward()
        assert all_finite([logits, *(p.grad for p in model.parameters() if p.grad is not None)])


# --- loss on extreme logits -----------------------------------------------------------------------
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_label_smoothing_on_extreme_logits_and_log_zero(smoothing):
    cases = [
        (torch.float32, [[1e30, -1e30, 0.0]]),
        (torch.float32, [[3e38, -3e38, 0.0]]),  # the logit spread overflows: log p = -inf
        (torch.float32, [[0.0, float("-inf"), 1.0]]),  # a token masked out: p = 0 exactly
        (torch.float32, [[0.0, torch.finfo(torch.float32).min, 1.0]]),
        (torch.float16, [[6e4, -6e4, 0.0]]),
        (torch.bfloat16, [[3e38, -3e38, 0.0]]),
    ]
    for dtype, values in cases:
        logits = torch.tensor(values, dtype=dtype, requires_grad=True)
        target = torch.tensor([2])  # a possible token
        loss = label_smoothed_cross_entropy(logits, target, smoothing=smoothing)
        loss.backward()
        assert loss.dtype == torch.float32
        assert all_finite([loss, logits.grad]), (dtype, values)
        # The gradient is softmax minus the smoothed target over the possible tokens: rows sum
        # to 0, and a token with p = 0 gets none.
        assert abs(float(logits.grad.float().sum())) < 1e-2, (dtype, values)
    # Ordinary logits: exactly PyTorch's label smoothing (the impossible-token rule changes nothing).
    logits, targets = torch.randn(6, 9), torch.randint(0, 9, (6,))
    torch.testing.assert_close(
        label_smoothed_cross_entropy(logits, targets, smoothing=smoothing),
        F.cross_entropy(logits, targets, label_smoothing=smoothing, reduction="sum"))
    # A masked token: the smoothing spreads over the other tokens only.
    masked = torch.tensor([[0.5, float("-inf"), 1.0, -0.5]])
    got = label_smoothed_cross_entropy(masked, torch.tensor([0]), smoothing=smoothing)
    log_p = torch.log_softmax(masked[:, [0, 2, 3]], dim=-1)
    want = (1 - smoothing) * -log_p[0, 0] - smoothing * log_p.mean()
    torch.testing.assert_close(got, want)
