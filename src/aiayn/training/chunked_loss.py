"""Output projection + label-smoothed cross-entropy in row chunks: the loss of CPU training.

The plain path materialises the logits (N, V), their log-softmax (N, V) and, in the backward pass, the
gradients of both: at N = 2048 targets and V = 8192 that is 64 MiB a tensor, written and read several
times, and on a CPU that memory traffic is a large part of a small model's step. Here ``chunk`` rows
are projected at a time; each chunk's loss and, when a gradient is needed, the gradient of its logits
(softmax - smoothed one-hot) are computed at once and turned into the gradients of the hidden states
and of the projection (the two products the plain backward runs), then the chunk's logits are dropped.
The backward pass only scales the stored gradients. Same value and gradients as ``F.linear`` +
``label_smoothed_cross_entropy`` up to summation order (tests/test_chunked_loss.py). Under autocast
the products run in its dtype, as the plain path's would; everything else in float32.

The loss is that of ``aiayn.training.loss`` (paper 5.4). ``projected_loss`` chooses the path by
device: chunked on the CPU, the logits and the plain loss elsewhere (a GPU runs the full logits'
few large kernels faster than many chunks). What it buys on the CPU, measured side by side with the
plain loss on whole training steps: ``benchmarks/loss_paths.py``, figures in docs/performance.md.

Legend: N rows (targets), D model width, V vocabulary, C chunk rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.training.loss import (label_smoothed_cross_entropy, smoothed_nll_of_rows,
                                 subtract_smoothed_targets)

DEFAULT_CHUNK = 1024  # rows per chunk: (1024, 8192) float32 logits = 32 MiB


def autocast_dtype(hidden: Tensor) -> torch.dtype | None:
    """The dtype autocast runs products in on ``hidden``'s device, or None outside autocast."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                smoothing: float, ignore_index: int, chunk: int, need_grad: bool) -> Tensor:
        low = autocast_dtype(hidden)
        dtype = low or hidden.dtype
        weight_c = weight.to(dtype)  # (V, D), cast once rather than once a chunk
        bias_c = None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        grad_bias = (torch.zeros_like(bias, dtype=torch.float32)
                     if need_grad and bias is not None else None)
        for begin in range(0, hidden.shape[0], chunk):
            h = hidden[begin: begin + chunk].to(dtype)  # (C, D)
            y = targets[begin: begin + chunk]  # (C,)
            logits = torch.mm(h, weight_c.t()) if bias_c is None else \
                torch.addmm(bias_c, h, weight_c.t())  # (C, V)
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (C, V)
            del logits
            keep = y != ignore_index  # (C,)
            safe = y.masked_fill(~keep, 0)  # (C,)
            target_log_probs = log_probs.gather(1, safe.unsqueeze(1)).squeeze(1)  # (C,)
            mean_log_probs = log_probs.mean(dim=-1) if smoothing > 0.0 else None  # (C,)
            # With log Z = 0, the NLL of the log-probabilities is that of the logits.
            total += smoothed_nll_of_rows(torch.zeros_like(target_log_probs), target_log_probs,
                                          mean_log_probs, keep, smoothing)
            if not need_grad:
                continue
            probabilities = log_probs.exp_().mul_(keep.unsqueeze(1))  # (C, V), zero on ignored rows
            grad = subtract_smoothed_targets(probabilities, safe, keep, smoothing).to(dtype)
            grad_hidden[begin: begin + chunk] = torch.mm(grad, weight_c)  # (C, D)
            grad_weight += torch.mm(grad.t(), h)  # (V, D)
            if grad_bias is not None:
                grad_bias += grad.sum(dim=0, dtype=torch.float32)
        if need_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype),
                                  grad_weight.new_empty(0) if grad_bias is None
                                  else grad_bias.to(bias.dtype))
        ctx.has_bias = bias is not None
        return total

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        return (grad_hidden * grad_output.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None,
                grad_weight * grad_output if ctx.needs_input_grad[1] else None,
                grad_bias * grad_output if ctx.has_bias and ctx.needs_input_grad[2] else None,
                None, None, None, None, None)


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                          bias: Tensor | None = None, smoothing: float = 0.0,
                          ignore_index: int = -100, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """SUM over non-ignored rows of the label-smoothed NLL of the logits ``hidden @ weight.T + bias``,
    computed ``chunk`` rows at a time (see the module docstring).

    Args:
        hidden: (N, D) final hidden states.
        weight: (V, D) output projection (the tied embedding matrix for tied models).
        targets: (N,) token ids; rows equal to ``ignore_index`` contribute nothing.
        bias: optional (V,) output bias.
        smoothing: eps in [0, 1).
        ignore_index: target value to skip.
        chunk: rows projected at a time.

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
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _ChunkedLoss.apply(hidden, weight, bias, targets, float(smoothing), int(ignore_index),
                              chunk, need_grad)


def chunks_loss(hidden: Tensor) -> bool:
    """Whether ``projected_loss`` takes the chunked path: on the CPU, for float32 hidden states,
    outside autocast or under bf16 autocast. Under fp16 autocast the plain path stays: the chunks
    compute their gradients in the forward pass, before a gradient scaler could keep fp16's small
    values from underflowing."""
    return (hidden.device.type == "cpu" and hidden.dtype == torch.float32
            and autocast_dtype(hidden) in (None, torch.bfloat16))


def projected_loss(hidden: Tensor, projection: nn.Module, targets: Tensor, *,
                   smoothing: float = 0.0, ignore_index: int = -100) -> Tensor:
    """Summed (label-smoothed) cross-entropy of ``projection(hidden)`` against ``targets``.

    ``hidden`` (..., D), ``targets`` (...); ``projection`` is an ``OutputProjection`` (``.weight``
    (V, D), ``.bias`` (V,) or None, ``.scale`` on the hidden states). Chunked where ``chunks_loss`` says so, else the logits and
    ``label_smoothed_cross_entropy``: the same value and gradients either way.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    if chunks_loss(hidden) and getattr(projection, "softcap", None) is None:  # chunks: no cap
        if projection.scale != 1.0:  # T5's D^-0.5 before the tied projection (scale_output)
            flat_hidden = flat_hidden * projection.scale
        return chunked_cross_entropy(flat_hidden, projection.weight, targets.reshape(-1),
                                     bias=projection.bias, smoothing=smoothing,
                                     ignore_index=ignore_index)
    return label_smoothed_cross_entropy(projection(flat_hidden), targets.reshape(-1),
                                        smoothing=smoothing, ignore_index=ignore_index)
