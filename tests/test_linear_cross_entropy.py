"""The chunked output-projection + cross-entropy equals the plain logits + loss path (value and
gradients), and the task losses that use it equal their plain path."""

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
from aiayn.training import linear_cross_entropy as lce
from aiayn.training.linear_cross_entropy import linear_cross_entropy
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
    """Loss and every parameter gradient of ``run(model)`` with the fused path on and off."""
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(lce, "enabled", enabled)
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


def test_translation_loss_equals_the_plain_path(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", output_bias=True))
    source = torch.randint(3, 100, (3, 9))
    source[0, 6:] = 0  # padded source
    target = torch.randint(3, 100, (3, 8))
    target[1, 5:] = 0  # padded target (ignored by the loss)
    batch = TranslationBatch(source, target[:, :-1], target[:, 1:], int((target[:, 1:] != 0).sum()),
                             int((source != 0).sum()), torch.arange(3))
    task = SimpleNamespace(label_smoothing=0.1)
    _compare(lambda m: TranslationTask.loss(task, m, batch), model, monkeypatch)


def test_translation_loss_without_padding_equals_the_masked_forward():
    """A full source batch skips the all-True mask: same loss as the model run with the mask."""
    from aiayn.tasks.translation import translation_loss

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny"))
    source, target = torch.randint(3, 100, (2, 6)), torch.randint(3, 100, (2, 5))
    logits = model(source, target[:, :-1], src_padding_mask=torch.ones_like(source, dtype=torch.bool))
    expected = F.cross_entropy(logits.flatten(0, 1), target[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(translation_loss(model, source, target[:, :-1], target[:, 1:]),
                               expected, rtol=1e-5, atol=1e-4)


def test_low_precision_hidden_states_and_fp16_autocast_keep_the_plain_path():
    hidden = torch.randn(4, 8)
    assert lce.fused_loss_applies(hidden)
    assert not lce.fused_loss_applies(hidden.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lce.fused_loss_applies(hidden)
        assert lce.autocast_dtype(hidden) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):  # a gradient scaler must see fp16 gradients
        assert not lce.fused_loss_applies(hidden)
    assert lce.autocast_dtype(hidden) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp16: the function itself
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("aligned", [False, True], ids=["cpu-path", "gpu-path"])
def test_under_autocast_value_and_gradients_match_the_plain_autocast_path(dtype, smoothing,
                                                                         with_bias, aligned,
                                                                         monkeypatch):
    """Under autocast the chunks' products run in its dtype like the plain path's: the same loss and
    input gradient up to summation order, and a weight gradient that differs by the rounding of each
    chunk's part (the plain path rounds the whole product once) on the weight's largest entries.
    Both chunk paths: the CPU's and the GPU's (vocabulary padded to 16 bytes, log_softmax), forced
    here on the CPU; V = 50 is padded to 56."""
    monkeypatch.setattr(lce, "aligned_path", aligned)
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


def test_the_gpu_chunk_path_pads_the_vocabulary_to_16_bytes_and_is_off_on_the_cpu():
    for dtype, size, padded in ((torch.bfloat16, 50257, 50264), (torch.float16, 50, 56),
                                (torch.float32, 7, 8), (torch.bfloat16, 64, 64)):
        assert lce.padded_size(size, dtype) == padded
    weight = torch.randn(50, 4)
    padded = lce._padded_vocabulary(weight, torch.bfloat16)
    assert padded.shape == (56, 4) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:50], weight.to(torch.bfloat16)) and not padded[50:].any()
    assert lce._padded_vocabulary(None, torch.bfloat16) is None
    cpu, meta = torch.zeros(1, 1), torch.zeros(1, 1, device="meta")
    assert lce.aligned_path is None and not lce.takes_aligned_path(cpu, cpu)
    assert lce.takes_aligned_path(meta, torch.nn.Parameter(meta))

    class Subclass(torch.Tensor):  # stands for FSDP's DTensor
        pass

    assert not lce.takes_aligned_path(meta, meta.as_subclass(Subclass))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's imports (torch.jit)
def test_a_model_compiled_in_place_trains_through_its_compiled_call():
    """``model.compile()`` (what the trainer's ``compile`` option does) compiles the module's call
    only; the task losses must then run that call, not the model's parts uncompiled."""
    from aiayn.tasks.translation import translation_loss
    from aiayn.training.linear_cross_entropy import runs_uncompiled

    torch.manual_seed(0)
    lm = CausalLM(TransformerConfig.preset("tiny", norm_first=True, n_encoder_layers=0))
    translator = Transformer(TransformerConfig.preset("tiny"))
    ids = torch.randint(3, 100, (2, 9))
    plain = [token_loss(lm, ids[:, :-1], ids[:, 1:]),
             translation_loss(translator, ids, ids[:, :-1], ids[:, 1:])]
    assert runs_uncompiled(lm, CausalLM) and runs_uncompiled(translator, Transformer)
    calls = []
    for model in (lm, translator):
        model.compile()  # lazy: nothing is compiled until the first call
        assert not runs_uncompiled(model, type(model))
        eager = model._call_impl  # stands in for the compiled call (compiling takes minutes here)
        model._compiled_call_impl = lambda *a, eager=eager, **k: calls.append(1) or eager(*a, **k)
    compiled = [token_loss(lm, ids[:, :-1], ids[:, 1:]),
                translation_loss(translator, ids, ids[:, :-1], ids[:, 1:])]
    assert len(calls) == 2  # each loss went through its model's (compiled) call
    for got, want in zip(compiled, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert not runs_uncompiled(torch.compile(CausalLM(TransformerConfig.preset("tiny"))), CausalLM)


@pytest.fixture
def mkl_logits(monkeypatch):
    """The float32 MKL path, where the logits go into the reused buffer (oneDNN's has no out=)."""
    from aiayn import onednn_linear

    monkeypatch.setattr(onednn_linear, "enabled", False)


weight_param = torch.nn.Parameter(_inputs(rows=37)[1].clone())  # the matrix whose buffer is reused


@pytest.mark.parametrize("with_bias", [False, True])
def test_reused_logits_buffer_gives_the_fresh_buffers_results(mkl_logits, monkeypatch, with_bias):
    hidden, weight, bias, targets = _inputs(rows=37)
    results = []
    for reuse in (False, True, True):  # the second reuse runs on the buffer the first one left
        monkeypatch.setattr(lce, "scratch_enabled", reuse)
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if reuse:
            leaves[1] = weight_param
        loss = linear_cross_entropy(leaves[0], leaves[1], targets,
                                    bias=leaves[2] if with_bias else None, smoothing=0.1, chunk=8)
        loss.backward()
        results.append((loss.detach(), leaves[0].grad.clone(), leaves[1].grad.clone()))
        leaves[1].grad = None
    for got in results[1:]:
        for value, expected in zip(got, results[0]):
            assert torch.equal(value, expected)


def test_the_buffer_is_kept_per_matrix_and_goes_with_it(mkl_logits):
    import gc

    hidden, weight, _, targets = _inputs(rows=20)
    weight = torch.nn.Parameter(weight)
    linear_cross_entropy(hidden, weight, targets, chunk=8).backward()
    buffer = lce.logits_scratch.held(weight)
    assert buffer is not None and buffer.numel() == 8 * weight.shape[0]  # one chunk's (C, V)
    linear_cross_entropy(hidden, weight, targets, chunk=8).backward()
    assert lce.logits_scratch.held(weight).data_ptr() == buffer.data_ptr()  # reused
    linear_cross_entropy(hidden, weight, targets, chunk=16).backward()  # larger chunks: a new one
    assert lce.logits_scratch.held(weight).numel() == 16 * weight.shape[0]
    gc.collect()  # other tests' matrices left in reference cycles go first
    count = len(lce.logits_scratch)
    del weight
    gc.collect()
    assert len(lce.logits_scratch) == count - 1


def test_a_call_while_the_buffer_is_taken_gets_its_own():
    weight = torch.randn(50, 12)
    scratch = lce.LogitsScratch()
    first = scratch.take(weight, 8)
    scratch.give_back(weight, first)
    taken = scratch.take(weight, 8)
    assert taken.data_ptr() == first.data_ptr()
    nested = scratch.take(weight, 8)  # e.g. a loss computed inside another on another thread
    assert nested.data_ptr() != taken.data_ptr() and scratch.held(weight) is None
    assert scratch.take(torch.randn(50, 12, dtype=torch.float64), 4).dtype == torch.float64


@pytest.mark.parametrize("block", [7, 16, 50, 64])  # a partial last block, exact blocks, one block
@pytest.mark.parametrize("with_bias", [False, True])
def test_logits_projected_in_vocabulary_blocks_equal_the_plain_path(mkl_logits, monkeypatch, block,
                                                                   with_bias):
    monkeypatch.setattr(lce, "VOCAB_BLOCK", block)
    hidden, weight, bias, targets = _inputs(rows=37, vocab=50)
    plain = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    fused = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    expected = label_smoothed_cross_entropy(
        F.linear(plain[0], plain[1], plain[2] if with_bias else None), targets, smoothing=0.1)
    expected.backward()
    got = linear_cross_entropy(fused[0], fused[1], targets, bias=fused[2] if with_bias else None,
                               smoothing=0.1, chunk=8)
    got.backward()
    assert lce.reuses_scratch(fused[0], fused[1])  # the blocked path is the one that ran
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    for leaf, reference in zip(fused, plain):
        if leaf.grad is not None:
            torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-5, atol=1e-6)
