"""Exact attention through batched matrix products, for training on a CPU at moderate lengths.

softmax(Q K^T / sqrt(d_k)) V (paper eq. 1) with the probabilities P kept for the backward pass, which
is then four batched products and two element-wise passes (with dO the gradient of the output O):

    dV = P^T dO      dP = dO V^T      dS = P * (dP - rowsum(dO * O))      dQ = dS K / sqrt(d_k)
    dK = dS^T Q / sqrt(d_k)

PyTorch's CPU flash kernel recomputes P in its backward and runs its small blocks at ~50 GFLOP/s,
where MKL's batched products of these shapes run at 110-145 (AMD EPYC Zen 4 without AVX-512, 2
threads). Causal attention goes by blocks of ``BLOCK`` queries, each against the keys up to its last
query only, so the products skip most of the masked half. A boolean mask (padding) is applied to
the scores before the softmax. Measured forward + backward against ``F.scaled_dot_product_attention``
(same machine, alternating, medians): (B, H, T, Dh) = (8, 4, 256, 64) causal 1.24x, (8, 4, 128,
64) causal 1.11x, (4, 8, 512, 64) causal 1.61x, (16, 4, 64, 64) causal 1.13x, not causal 1.12x,
(32, 12, 128, 32) not causal 1.02x; see docs/performance.md, sixteenth pass.

The price is memory: P is (B, H, T, S) floats held from forward to backward (flash keeps O(T)), so
``applies`` limits the keys to ``MAX_KEYS``; and a fixed cost a call, so small calls (one sequence
of a packed batch) keep the fused kernel (``MIN_SCORES``), and so do unmasked calls over few keys
(``MIN_KEYS_UNMASKED``). Inference keeps the fused kernel (its forward alone is as fast or faster,
and nothing is kept), so does dropout on the weights.

Legend: B batch, H heads, T queries, S keys, Dh head width; ``BH`` = B * H.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn import functorch_guard

enabled = True  # module switch: tests and A/B benchmarks turn it off
BLOCK = 128  # causal query block: 64 and 128 measured level at T = 256
MAX_KEYS = 512  # P (B, H, T, S) floats kept for the backward: 8 MiB at B 8, H 4, T = S = 256
# Below this many scores (B * H * T * S) a call's fixed cost (~0.15 ms more than the fused kernel's)
# outweighs what the products save: measured 0.53-0.92x at 6,400-65,536 (one sequence of a packed
# batch, (2, 4, 64, 64)), 1.01-1.06x at 131,072 ((2, 4, 128, 128)), 1.34-1.49x at 131,072 as
# (8, 4, 64, 64).
MIN_SCORES = 1 << 17
# Without a mask, below this many keys SDPA's unmasked flash kernel is as fast in whole steps: the
# enc-dec benchmark's step (64 keys) ran 0.976-0.987x through this module built from Marian, 0.987-
# 1.034x from torch.nn. With a mask SDPA's masked path is the slow one: the padded translation step
# gained 1.018-1.032x, all of it from the masked calls (its unmasked ones through here too: 0.999x).
MIN_KEYS_UNMASKED = 128
_softmax_into = torch.ops.aten._softmax.out


def applies(q: Tensor, k: Tensor, v: Tensor, dropout: float, *, masked: bool = False) -> bool:
    """Whether ``attention`` should replace the fused kernel: switched on, no ``torch.func``
    transform, a gradient to compute, plain float32 CPU tensors (not a subclass such as a DTensor),
    no dropout, at most ``MAX_KEYS`` keys, at least ``MIN_SCORES`` scores, and ``masked`` (a mask
    besides the causal flag) or ``MIN_KEYS_UNMASKED`` keys. Inside a ``torch.compile`` trace the
    call goes through ``attention_between_graphs``."""
    keys = k.shape[-2]
    scores = q.shape[0] * q.shape[1] * q.shape[2] * keys
    return (enabled and dropout == 0.0 and torch.is_grad_enabled() and scores >= MIN_SCORES
            and (masked or keys >= MIN_KEYS_UNMASKED) and keys <= MAX_KEYS
            and (q.requires_grad or k.requires_grad or v.requires_grad)
            and all(type(t) is Tensor for t in (q, k, v))
            and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not functorch_guard.transform_active())


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              mask: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v for q (B, H, T, Dh), k and v (B, H, S, Dh) -> (B, H, T, Dh).

    ``causal``: query t attends to keys 0..t (T == S). ``mask``: boolean, True = may attend,
    broadcastable to (B, H, T, S) (aiayn.masks; with ``causal`` both apply); a query with no key to
    attend to returns zeros, as every kernel's does. No dropout (see ``applies``).
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"expected q (B, H, T, Dh) and k, v (B, H, S, Dh), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[2]} and "
                         f"{k.shape[2]}")
    if mask is not None:
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if (mask.dtype != torch.bool or mask.dim() > 4
                or any(m not in (1, n) for m, n in zip(reversed(mask.shape), reversed(full)))):
            raise ValueError(f"expected a boolean mask broadcastable to (B, H, T, S) = {full}, got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, T|1, S|1)
    return _GemmAttention.apply(q, k, v, causal, mask)


# ``attention`` as a graph break inside a ``torch.compile`` trace: it runs eagerly between the compiled
# graphs on either side, which keep their fusions (traced into the graph, the products compiled no
# faster and the first step took 3.5x as long; see docs/performance.md). ``torch._disable_dynamo`` is
# ``torch.compiler.disable`` that imports Dynamo on the first call instead of at import: importing it
# here doubled ``import aiayn``'s time (1.6 -> 3.3 s).
attention_between_graphs = torch._disable_dynamo(attention)


def _query_blocks(queries: int, causal: bool) -> list[tuple[int, int]]:
    if not causal:
        return [(0, queries)]
    return [(start, min(start + BLOCK, queries)) for start in range(0, queries, BLOCK)]


class _GemmAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None) -> Tensor:
        batch, heads, queries, width = q.shape
        keys = k.shape[2]
        scale = width ** -0.5
        scaled_q = q.new_empty(batch * heads, queries, width)  # (BH, T, Dh)
        torch.mul(q, scale, out=scaled_q.view(q.shape))  # one pass (a plain mul keeps q's layout)
        k3 = k.reshape(batch * heads, keys, width)  # (BH, S, Dh)
        v3 = v.reshape(batch * heads, keys, width)
        out = torch.empty_like(scaled_q)  # (BH, T, Dh)
        blocks = _query_blocks(queries, causal)
        if causal:  # a block's own diagonal square: query i sees key j <= i (sliced for a short last)
            size = blocks[0][1]
            future = torch.ones(size, size, dtype=torch.bool, device=q.device).triu_(1)
        probabilities = []
        for start, end in blocks:
            seen = end if causal else keys  # keys a causal block can see: 0 .. its last query
            p = torch.bmm(scaled_q[:, start:end], k3[:, :seen].transpose(1, 2))  # (BH, n, seen)
            if causal:
                p[:, :, start:].masked_fill_(future[: end - start, : end - start], float("-inf"))
            if mask is not None:
                allowed = mask if mask.shape[2] == 1 else mask[:, :, start:end]
                allowed = allowed if allowed.shape[3] == 1 else allowed[..., :seen]
                p.view(batch, heads, end - start, seen).masked_fill_(~allowed, float("-inf"))
                # A query with no key left (all masked, causally or not) would get NaN: zero it.
                no_key = p.amax(dim=-1, keepdim=True) == float("-inf")  # (BH, n, 1)
            _softmax_into(p, -1, False, out=p)
            if mask is not None:
                p.masked_fill_(no_key, 0.0)
            if len(blocks) == 1:
                torch.bmm(p, v3[:, :seen], out=out)
            else:
                out[:, start:end] = torch.bmm(p, v3[:, :seen])
            probabilities.append(p)
        ctx.save_for_backward(scaled_q, k3, v3, out, *probabilities)
        ctx.blocks, ctx.scale, ctx.shapes = blocks, scale, (q.shape, k.shape)
        return out.view(q.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        scaled_q, k3, v3, out, *probabilities = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        keys = k3.shape[1]
        grad_out = grad_out.reshape(out.shape)  # (BH, T, Dh)
        row_dot = (grad_out * out).sum(dim=-1, keepdim=True)  # (BH, T, 1): rowsum(dO * O)
        grad_q = torch.empty_like(scaled_q)
        grad_k = torch.empty_like(k3)
        grad_v = torch.empty_like(v3)
        # The last block sees every key, so it writes grad_k and grad_v whole; earlier blocks add.
        for (start, end), p in reversed(list(zip(ctx.blocks, probabilities))):
            seen = p.shape[-1]
            grad_o = grad_out[:, start:end]  # (BH, n, Dh)
            grad_s = torch.bmm(grad_o, v3[:, :seen].transpose(1, 2))  # dP (BH, n, seen)
            grad_s.sub_(row_dot[:, start:end]).mul_(p)  # dS
            if seen == keys:
                torch.bmm(p.transpose(1, 2), grad_o, out=grad_v)
                torch.bmm(grad_s.transpose(1, 2), scaled_q[:, start:end], out=grad_k)
            else:
                grad_v[:, :seen] += torch.bmm(p.transpose(1, 2), grad_o)
                grad_k[:, :seen] += torch.bmm(grad_s.transpose(1, 2), scaled_q[:, start:end])
            grad_q[:, start:end] = torch.bmm(grad_s, k3[:, :seen])
        grad_q.mul_(ctx.scale)
        return grad_q.view(q_shape), grad_k.view(k_shape), grad_v.view(k_shape), None, None
