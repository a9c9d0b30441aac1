"""Output projection + (label-smoothed) cross-entropy, computed in row chunks (training fast path).

The plain loss path materialises the logits (N, V), their log-softmax (N, V) and, in backward, the
gradient of both: at N = 2048 targets and V = 8192 that is 64 MiB per tensor, written and read
several times. ``linear_cross_entropy`` projects ``chunk`` rows at a time, computes their loss and,
when a gradient is needed, the gradient of their logits right away (softmax - smoothed one-hot), turns
it into the gradients of the hidden states and of the projection matrix (two matmuls, exactly the ones
the plain backward does), and drops the chunk's logits. Backward then only scales the stored gradients
by the incoming one. Same loss and gradients as ``linear`` + ``label_smoothed_cross_entropy`` (summation
order aside; tests/test_linear_cross_entropy.py); the peak memory of the loss becomes O(chunk x V).
Under bf16 autocast the three products run in bf16, as the plain path's would, and everything else in
float32; the weight gradient is then rounded once per chunk and summed in float32 (a bf16 LM training
step 1.16-1.21x the plain autocast path on a Zen 4, docs/performance.md, twelfth pass).

The smoothed loss is the one of ``aiayn.training.loss`` (paper 5.4): (1 - eps) * -log p[y] +
eps * mean_v(-log p[v]), over the V possible tokens; its gradient w.r.t. the logits z is
softmax(z) - (1 - eps) * onehot(y) - eps / V. Logits are finite here (a matmul of finite values), so
the "impossible token" case of the general loss (a -inf logit) does not arise.

Legend: N rows (targets), D model width, V vocabulary, C chunk rows.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from aiayn import onednn_linear
from aiayn.training.loss import (label_smoothed_cross_entropy, smoothed_nll_of_rows,
                                 subtract_smoothed_targets)

DEFAULT_CHUNK = 1024  # rows per chunk: (1024, 8192) float32 logits = 32 MiB; big enough for GEMM speed
# The float32 MKL path projects a chunk onto this many vocabulary rows per product, into its slice of
# the chunk's logits: MKL's AVX2 product of (1024, 256) x (256, 8192) ran at ~131 GFLOP/s, in blocks
# of 1024 at ~144 (the whole loss with blocks of 512 or 2048: ~2 % slower than with 1024). Measured
# (AMD EPYC Zen 4 without AVX-512, 2 threads): the loss's forward and backward at 1024 / 2048 rows
# 1.017-1.033x / 1.043x; whole training steps within their noise (``python3
# benchmarks/fast_path_ab.py lm-vocab-blocks seq2seq-vocab-blocks``: LM 0.996 / 1.015, enc-dec 1.002).
VOCAB_BLOCK = 1024


class LogitsScratch:
    """One reusable chunk-logits buffer per projection matrix, kept while the matrix lives.

    A chunk's (1024, 8192) float32 logits are 32 MiB, glibc's largest mmap threshold: a fresh buffer
    every chunk is a fresh mapping whose first write faults in every page (7.6 ms to fill against
    0.9 ms reused, docs/performance.md, fourteenth pass), every training step. The float32 MKL path
    writes its logits into this buffer instead (``torch.addmm(..., out=)``). Measured (AMD EPYC Zen 4
    without AVX-512, 2 threads, ``python3 benchmarks/fast_path_ab.py seq2seq-scratch lm-scratch``):
    minor page faults a step 12-15k -> ~7k (enc-dec) and 17-18.5k -> 0-2.3k (LM), the enc-dec step
    1.023x / 1.032x, the LM step 0.993x / 1.010x (two runs each). A call takes the buffer
    out while it works, so a nested or concurrent call with the same matrix makes its own; an entry
    goes when its matrix is garbage collected, or with ``clear()``.
    """

    def __init__(self):
        self._buffers: dict[int, tuple[weakref.ref, Tensor]] = {}

    def take(self, weight: Tensor, rows: int) -> Tensor:
        """A (rows, V) buffer of ``weight``'s dtype and device (V = weight rows)."""
        entry = self._buffers.pop(id(weight), None)
        size = rows * weight.shape[0]
        if (entry is not None and entry[0]() is weight and entry[1].numel() >= size
                and entry[1].dtype == weight.dtype and entry[1].device == weight.device):
            return entry[1][:size].view(rows, weight.shape[0])
        return torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=weight.device)

    def give_back(self, weight: Tensor, buffer: Tensor) -> None:
        key = id(weight)
        ref = weakref.ref(weight, lambda _, key=key: self._buffers.pop(key, None))
        self._buffers[key] = (ref, buffer.view(-1))

    def held(self, weight: Tensor) -> Tensor | None:
        """The flat buffer kept for ``weight``, if any."""
        entry = self._buffers.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    def clear(self) -> None:
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)


logits_scratch = LogitsScratch()
scratch_enabled = True  # module switch (A/B benchmarks turn it off)


def reuses_scratch(h: Tensor, weight: Tensor) -> bool:
    """Whether a chunk's float32 logits go into ``logits_scratch``: switched on, eager, plain CPU
    tensors (a GPU's caching allocator reuses memory already; a tensor subclass such as FSDP's
    DTensor cannot be written into a plain buffer)."""
    plain = onednn_linear.PLAIN_TYPES
    return (scratch_enabled and weight.device.type == "cpu" and type(h) in plain
            and type(weight) in plain and not torch.compiler.is_compiling())


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                smoothing: float, ignore_index: int, chunk: int, need_grad: bool) -> Tensor:
        rows = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight) if need_grad else None
        grad_bias = torch.zeros_like(bias) if need_grad and bias is not None else None
        # Under autocast the three products run in its dtype, as the plain path's would (the
        # projection's and its backward's); the weight is cast once, not once per chunk.
        low = autocast_dtype(hidden)
        aligned = low is not None and takes_aligned_path(hidden, weight)
        if aligned:  # (Vp, D) and (Vp,), zero past V
            weight_low, bias_low = _padded_vocabulary(weight, low), _padded_vocabulary(bias, low)
        elif low is not None:
            weight_low = weight.to(low)  # (V, D)
            bias_low = None if bias is None else bias.to(low)
        scratch = None
        for begin in range(0, rows, chunk):
            h = hidden[begin: begin + chunk]  # (C, D)
            y = targets[begin: begin + chunk]  # (C,)
            if aligned:
                part = _aligned_low_precision_chunk(h.to(low), weight_low, bias_low, y,
                                                    weight.shape[0], ignore_index, smoothing,
                                                    need_grad)
                total += part[0]
                if need_grad:
                    grad_hidden[begin: begin + chunk] = part[1]
                    grad_weight += part[2]
                    if grad_bias is not None:
                        grad_bias += part[3]
                continue
            on_onednn = onednn_linear.applies(h, weight)
            if low is not None:
                h = h.to(low)
                logits = (torch.mm(h, weight_low.t()) if bias is None
                          else torch.addmm(bias_low, h, weight_low.t()))  # (C, V)
            elif on_onednn:
                logits = onednn_linear.matmul_transposed(h, weight, bias)  # (C, V)
            elif reuses_scratch(h, weight):
                if scratch is None:  # one buffer for every chunk of the call (the first is the largest)
                    scratch = logits_scratch.take(weight, min(chunk, rows))
                logits = scratch[: h.shape[0]]  # (C, V)
                for start in range(0, weight.shape[0], VOCAB_BLOCK):  # (C, VOCAB_BLOCK) at a time
                    block = slice(start, start + VOCAB_BLOCK)
                    if bias is None:
                        torch.mm(h, weight[block].t(), out=logits[:, block])
                    else:
                        torch.addmm(bias[block], h, weight[block].t(), out=logits[:, block])
            else:
                logits = (torch.mm(h, weight.t()) if bias is None
                          else torch.addmm(bias, h, weight.t()))  # (C, V)
            logits = logits.float()  # (C, V): the chunk's own buffer, overwritten below
            keep = y != ignore_index  # (C,)
            safe = y.masked_fill(~keep, 0)  # (C,)
            # log Z = max + log sum exp(z - max), with exp(z - max) written over the logits: that
            # buffer is then also the unnormalised softmax the gradient needs (no second exp pass,
            # no (C, V) temporary; torch.logsumexp allocates one).
            peak = logits.amax(dim=-1, keepdim=True)  # (C, 1)
            target_logits = logits.gather(1, safe.unsqueeze(1)).squeeze(1)  # (C,)
            mean_logits = logits.mean(dim=-1) if smoothing > 0.0 else None  # (C,)
            exps = logits.sub_(peak).exp_()  # (C, V)
            sums = exps.sum(dim=-1, keepdim=True)  # (C, 1)
            log_z = (peak + sums.log()).squeeze(1)  # (C,)
            total += smoothed_nll_of_rows(log_z, target_logits, mean_logits, keep, smoothing)
            if not need_grad:
                continue
            # The softmax on kept rows (zero on ignored ones), in place, then the targets' part.
            kept = keep.to(exps.dtype).unsqueeze(1)  # (C, 1)
            grad = subtract_smoothed_targets(exps.mul_(kept / sums), safe, keep, smoothing)
            if low is not None:
                # The plain path rounds the logits' gradient to the autocast dtype too; the weight
                # gradient is rounded once per chunk and summed in float32 (the plain path rounds
                # the whole (V, N) x (N, D) product once).
                grad = grad.to(low)  # (C, V)
                grad_hidden[begin: begin + chunk] = torch.mm(grad, weight_low)  # (C, D)
                grad_weight += torch.mm(grad.t(), h)  # (V, D)
                if grad_bias is not None:
                    grad_bias += grad.sum(dim=0, dtype=torch.float32)
                continue
            grad = grad.to(hidden.dtype)
            if on_onednn:
                grad_hidden[begin: begin + chunk] = onednn_linear.matmul(grad, weight)  # (C, D)
            else:
                torch.mm(grad, weight, out=grad_hidden[begin: begin + chunk])  # (C, D)
            grad_weight.addmm_(grad.t(), h)  # (V, D) += (V, C) @ (C, D): MKL (faster here)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0)
        if scratch is not None:
            logits_scratch.give_back(weight, scratch)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight,
                                  grad_bias if grad_bias is not None else grad_weight.new_empty(0))
        ctx.has_bias = bias is not None
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_output.to(grad_hidden.dtype)
        return (grad_hidden * scale if ctx.needs_input_grad[0] else None,
                grad_weight * scale if ctx.needs_input_grad[1] else None,
                grad_bias * scale if ctx.has_bias and ctx.needs_input_grad[2] else None,
                None, None, None, None, None)


# On a GPU (an H100 and an H200 under bf16 autocast, GPT-2's V = 50257) the chunked loss was the slow
# part of a training step, for two reasons. cuBLAS gives a product whose size or row stride along V
# is not a multiple of 16 bytes old, untiled kernels (cutlass sm75 "s1688": 0.6-0.8 ms a chunk
# for ~0.11 ms of tensor-core work; nanoGPT pads GPT-2's vocabulary to 50304 for this reason). And
# the normaliser took six elementwise passes over the float32 chunk (cast, max, subtract, exp, sum,
# scale) where ``log_softmax(..., dtype=float32)`` reads the low-precision logits once. So off the
# CPU, under autocast, the cast weight (and bias) get zero rows up to a multiple of 16 bytes (Vp), the
# three products run at Vp (the padded logits are dropped, the padded gradient columns are zero), and
# the log-probabilities come from one log_softmax. Padding the logits' rows alone (the first version)
# took a GPT-2-small step from 43.9-44.1 to 40.6-41.0 ms on an H200 (benchmarks/gpu_profile.py); the
# two gradient products still ran the sm75 kernels there (11.9 ms of the step), hence the padded
# vocabulary (docs/performance.md, eighteenth pass). The CPU keeps the path it was measured on.
ALIGN_BYTES = 16
aligned_path: bool | None = None  # None: off the CPU only; True / False force it (tests, A/B runs)


def takes_aligned_path(hidden: Tensor, weight: Tensor) -> bool:
    """Off the CPU, for plain tensors (a subclass such as FSDP's DTensor keeps the general path:
    its padded copy would be built through the subclass's own operators); ``aligned_path`` forces."""
    if aligned_path is not None:
        return aligned_path
    plain = onednn_linear.PLAIN_TYPES
    return hidden.device.type != "cpu" and type(hidden) in plain and type(weight) in plain


def padded_size(size: int, dtype: torch.dtype) -> int:
    """``size`` rounded up to a multiple of ALIGN_BYTES worth of ``dtype`` elements."""
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-size // step) * step


def _padded_vocabulary(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``tensor`` (V, ...) cast to ``dtype`` with zero rows appended up to ``padded_size(V)``."""
    if tensor is None:
        return None
    vocab = tensor.shape[0]
    padded = tensor.new_empty((padded_size(vocab, dtype), *tensor.shape[1:]), dtype=dtype)
    padded[:vocab].copy_(tensor)
    padded[vocab:].zero_()
    return padded


def _aligned_low_precision_chunk(h: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor,
                                 vocab: int, ignore_index: int, smoothing: float, need_grad: bool):
    """One chunk's summed loss and, with ``need_grad``, its gradients (hidden (C, D) in the products'
    dtype, weight (V, D) and bias (V,) float32), from h (C, D) and the cast, padded weight (Vp, D)
    and bias (Vp,) (rows past ``vocab`` zero)."""
    keep = y != ignore_index  # (C,)
    safe = y.masked_fill(~keep, 0)  # (C,)
    logits = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())  # (C, Vp)
    log_probs = torch.log_softmax(logits[:, :vocab], dim=-1, dtype=torch.float32)  # (C, V)
    del logits
    target_log_probs = log_probs.gather(1, safe.unsqueeze(1)).squeeze(1)  # (C,)
    mean_log_probs = log_probs.mean(dim=-1) if smoothing > 0.0 else None  # (C,)
    # With log Z = 0, smoothed_nll_of_rows of the log-probabilities is that of the logits.
    loss = smoothed_nll_of_rows(torch.zeros_like(target_log_probs), target_log_probs,
                                mean_log_probs, keep, smoothing)
    if not need_grad:
        return (loss,)
    kept = keep.to(log_probs.dtype).unsqueeze(1)  # (C, 1)
    grad32 = subtract_smoothed_targets(log_probs.exp_(), safe, keep, smoothing)  # (C, V)
    grad = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)  # (C, Vp)
    torch.mul(grad32, kept, out=grad[:, :vocab])  # ignored rows to zero and the cast, in one pass
    grad[:, vocab:].zero_()  # uninitialised memory may hold NaN, and NaN x 0 is NaN
    del grad32
    return (loss, torch.mm(grad, weight), torch.mm(grad.t(), h)[:vocab],
            grad[:, :vocab].sum(dim=0, dtype=torch.float32) if bias is not None else None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                         bias: Tensor | None = None, smoothing: float = 0.0,
                         ignore_index: int = -100, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """SUM over non-ignored rows of the label-smoothed NLL of the logits ``hidden @ weight.T + bias``.

    Equals ``label_smoothed_cross_entropy(F.linear(hidden, weight, bias), targets, ...)`` without
    materialising the (N, V) logits (see the module docstring).

    Args:
        hidden: (N, D) final hidden states.
        weight: (V, D) output projection (the tied embedding matrix for tied models).
        targets: (N,) token ids; rows equal to ``ignore_index`` contribute nothing.
        bias: optional (V,) output bias.
        smoothing: eps in [0, 1).
        ignore_index: target value to skip.
        chunk: rows projected at a time (peak extra memory ~ 2 x chunk x V floats).

    Returns:
        A float32 scalar; differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.

    Raises:
        ValueError: mismatched shapes, a smoothing outside [0, 1) or a chunk < 1.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden (N, D) and weight (V, D), got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"expected targets (N={hidden.shape[0]},), got {tuple(targets.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"expected bias (V={weight.shape[0]},), got {tuple(bias.shape)}")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, float(smoothing),
                                     int(ignore_index), int(chunk), need_grad)


enabled = True  # module switch: tests and A/B benchmarks turn the fused path off


def fused_loss_applies(hidden: Tensor) -> bool:
    """Whether ``projected_loss`` takes the chunked path: switched on and float32 hidden states,
    without autocast or under bf16 autocast (its products then run in bf16). Under fp16 autocast the
    plain path stays: the chunks compute their gradients in the forward pass, before a gradient
    scaler's factor could keep fp16's small values from underflowing. Hidden states stored in
    bf16/fp16 keep the plain path too."""
    return enabled and hidden.dtype == torch.float32 and autocast_dtype(hidden) in (None,
                                                                                   torch.bfloat16)


def autocast_dtype(hidden: Tensor) -> torch.dtype | None:
    """The dtype autocast runs products in on ``hidden``'s device, or None outside autocast."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def runs_uncompiled(model: torch.nn.Module, model_class: type) -> bool:
    """Whether ``model`` is a plain ``model_class`` whose parts a loss may call directly.

    Not when wrapped (DDP, FSDP's wrapper, ``torch.compile(model)``) and not after
    ``model.compile()``: that compiles the module's call, so only its forward runs compiled, and
    calling its parts would silently train uncompiled.
    """
    return type(model) is model_class and getattr(model, "_compiled_call_impl", None) is None


def projected_loss(hidden: Tensor, projection: torch.nn.Module, targets: Tensor, *,
                   smoothing: float = 0.0, ignore_index: int = -100) -> Tensor:
    """Summed (label-smoothed) cross-entropy of ``projection(hidden)`` against ``targets``.

    ``hidden`` (..., D), ``targets`` (...); ``projection`` is an ``OutputProjection`` (``.weight``
    (V, D), ``.bias`` (V,) or None). Chunked through ``linear_cross_entropy`` when
    ``fused_loss_applies``, else the logits and ``label_smoothed_cross_entropy``: the same value and
    gradients either way.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    if fused_loss_applies(hidden):
        return linear_cross_entropy(flat_hidden, projection.weight, targets.reshape(-1),
                                    bias=projection.bias, smoothing=smoothing,
                                    ignore_index=ignore_index)
    return label_smoothed_cross_entropy(projection(flat_hidden), targets.reshape(-1),
                                        smoothing=smoothing, ignore_index=ignore_index)
