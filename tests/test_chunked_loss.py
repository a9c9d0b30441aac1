"""The chunked output projection + cross-entropy (aiayn.training.chunked_loss) equals the plain
logits + loss path (value and gradients), and the task losses that use it equal their plain path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from aiayn import TransformerConfig
from aiayn.data.batching import TranslationBatch
from aiayn.models import CausalLM, Transformer
from aiayn.tasks.lm import token_loss
from aiayn.tasks.translation import TranslationTask
from aiayn.training import chunked_loss
from aiayn.training.chunked_loss import chunked_cross_entropy as linear_cross_entropy
from aiayn.training.loss import label_smoothed_cross_entropy


def _inputs(rows=37, width=12, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator)
    bias = torch.randn(vocab, generator=generator)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::5] = -100  # ignored rows
    return hidden, weight, bias, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
def test_value_and_gradients_equal_the_plain_path(smoothing, with_bias, chunk):
    hidden, weight, bias, targets = _inputs()
    plain = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    fused = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    expected = label_smoothed_cross_entropy(
        F.linear(plain[0], plain[1], plain[2] if with_bias else None), targets,
        smoothing=smoothing)
    (expected * 0.37).backward()  # a non-unit upstream gradient is scaled through
    got = linear_cross_entropy(fused[0], fused[1], targets, bias=fused[2] if with_bias else None,
                               smoothing=smoothing, chunk=chunk)
    (got * 0.37).backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused[0].grad, plain[0].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1].grad, plain[1].grad, rtol=1e-5, atol=1e-6)
    if with_bias:
        torch.testing.assert_close(fused[2].grad, plain[2].grad, rtol=1e-5, atol=1e-6)
    assert not fused[0].grad[targets == -100].any()  # ignored rows get no gradient


@pytest.mark.parametrize("scale", [30.0, 300.0])  # logits in the hundreds / thousands
def test_large_logits_stay_finite_and_match_a_float64_reference(scale):
    """exp(z - max) never overflows, and saturated softmaxes keep their loss and gradients: checked
    against the plain path in float64 (the float32 plain path itself is off by 6e-5 at scale 300)."""
    hidden, weight, _, targets = _inputs()
    hidden = hidden * scale
    reference = [t.double().requires_grad_() for t in (hidden, weight)]
    fused = [t.clone().requires_grad_() for t in (hidden, weight)]
    expected = label_smoothed_cross_entropy(F.linear(*reference), targets, smoothing=0.1)
    expected.backward()
    got = linear_cross_entropy(*fused, targets, smoothing=0.1, chunk=8)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(fused[0].grad).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(fused[0].grad.double(), reference[0].grad, rtol=0, atol=1e-5)
    # the weight gradient sums hidden states of size ~scale: its rounding grows with them
    torch.testing.assert_close(fused[1].grad.double(), reference[1].grad, rtol=0, atol=2e-6 * scale)


def test_tied_weight_accumulates_both_gradients():
    """A weight used by an embedding and by the loss gets the sum of both gradients."""
    hidden, weight, _, targets = _inputs()
    ids = torch.randint(0, weight.shape[0], (5,))
    grads = []
    for fused in (False, True):
        w = weight.clone().requires_grad_()
        h = hidden + w[ids].sum()  # the embedding use of the same matrix
        loss = (linear_cross_entropy(h, w, targets, chunk=8) if fused
                else F.cross_entropy(F.linear(h, w), targets, reduction="sum"))
        loss.backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_without_gradient_gives_the_value_only():
    hidden, weight, bias, targets = _inputs()
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, targets, bias=bias, smoothing=0.1, chunk=7)
    expected = label_smoothed_cross_entropy(F.linear(hidden, weight, bias), targets, smoothing=0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert not got.requires_grad


@pytest.mark.parametrize("kwargs, message", [
    (dict(smoothing=1.0), "smoothing"), (dict(chunk=0), "chunk"),
    (dict(bias=torch.zeros(3)), "bias"), (dict(targets=torch.zeros(2, dtype=torch.long)), "targets"),
])
def test_bad_arguments_name_the_problem(kwargs, message):
    hidden, weight, _, targets = _inputs()
    arguments = {"targets": targets, **kwargs}
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(hidden, weight, arguments.pop("targets"), **arguments)
    with pytest.raises(ValueError, match="hidden"):
        linear_cross_entropy(hidden[:, :3], weight, targets)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _compare(run, model, monkeypatch):
    """Loss and every parameter gradient of ``run(model)`` with the chunked path off and on."""
    results = []
    for chunked in (False, True):
        monkeypatch.setattr(chunked_loss, "chunks_loss", lambda hidden, on=chunked: on)
        model.zero_grad(set_to_none=True)
        loss = run(model)
        loss.backward()
        results.append((loss.detach(), _grads(model)))
    (plain_loss, plain_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-4)
    assert fused_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_lm_token_loss_equals_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.preset("tiny", norm_first=True, n_encoder_layers=0))
    ids = torch.randint(0, 100, (3, 17))
    _compare(lambda m: token_loss(m, ids[:, :-1], ids[:, 1:]), model, monkeypatch)


def test_lm_token_loss_passes_the_logits_to_the_cross_entropy_in_their_own_dtype(monkeypatch):
    """The plain path (here bf16 weights on the CPU; on a GPU every dtype) hands F.cross_entropy
    the logits as the model made them, as nanoGPT does: under CUDA autocast a float32 cast there
    would turn the bf16 log-softmax into a float32 one over (B * T, V) (docs/performance.md)."""
    import aiayn.tasks.lm as lm

    seen, original = [], F.cross_entropy

    def cross_entropy(logits, *args, **kwargs):
        seen.append(logits.dtype)
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(lm.F, "cross_entropy", cross_entropy)
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.preset("tiny", norm_first=True, n_encoder_layers=0))
    ids = torch.randint(0, 100, (3, 17))
    loss = token_loss(model.bfloat16(), ids[:, :-1], ids[:, 1:])
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32


def test_translation_loss_equals_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", output_bias=True))
    source = torch.randint(3, 100, (3, 9))
    source[0, 6:] = 0  # padded source
    target = torch.randint(3, 100, (3, 8))
    target[1, 5:] = 0  # padded target (ignored by the loss)
    batch = TranslationBatch(source, target[:, :-1], target[:, 1:], int((target[:, 1:] != 0).sum()),
                             int((source != 0).sum()), torch.arange(3))
    task = SimpleNamespace(label_smoothing=0.1, pad_id=0)
    _compare(lambda m: TranslationTask.loss(task, m, batch), model, monkeypatch)


def test_the_loss_path_is_chosen_by_device_and_dtype():
    """Chunked on the CPU for float32 hidden states (bf16 autocast too); the plain logits path for
    stored bf16, under fp16 autocast (a gradient scaler must see fp16 gradients) and off the CPU."""
    hidden = torch.randn(4, 8)
    assert chunked_loss.chunks_loss(hidden)
    assert not chunked_loss.chunks_loss(hidden.bfloat16())
    assert not chunked_loss.chunks_loss(hidden.to("meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert chunked_loss.chunks_loss(hidden)
        assert chunked_loss.autocast_dtype(hidden) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert not chunked_loss.chunks_loss(hidden)
    assert chunked_loss.autocast_dtype(hidden) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp16: the function itself
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_under_autocast_value_and_gradients_match_the_plain_autocast_path(dtype, smoothing,
                                                                         with_bias):
    """Under autocast the chunks' products run in its dtype like the plain path's: the same loss and
    input gradient up to summation order, and a weight gradient that differs by the rounding of each
    chunk's part (the plain path rounds the whole product once) on the weight's largest entries."""
    hidden, weight, bias, targets = _inputs(rows=300, width=16, vocab=50)
    plain = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    fused = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    with torch.autocast("cpu", dtype=dtype):
        expected = label_smoothed_cross_entropy(
            F.linear(plain[0], plain[1], plain[2] if with_bias else None), targets,
            smoothing=smoothing)
        got = linear_cross_entropy(fused[0], fused[1], targets,
                                   bias=fused[2] if with_bias else None, smoothing=smoothing,
                                   chunk=64)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-3)
    expected.backward()
    got.backward()
    resolution = torch.finfo(dtype).eps  # one rounding, relative
    for index in range(3 if with_bias else 2):
        scale = plain[index].grad.abs().max()
        assert fused[index].grad.dtype == torch.float32
        torch.testing.assert_close(fused[index].grad, plain[index].grad, rtol=0,
                                   atol=float(scale) * 2 * resolution)
