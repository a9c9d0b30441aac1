"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Legend: B batch, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def filter_logits(logits: Tensor, *, top_k: int | None = None, top_p: float | None = None
                  ) -> Tensor:
    """Logits (B, V) with -inf outside the top-k set and outside the top-p nucleus.

    top-k keeps the k largest logits (ties at the k-th value are kept). top-p keeps the smallest set of
    most likely tokens whose probability mass reaches ``top_p`` (Holtzman et al. 2020); the most likely
    token is always kept. Both together: top-k first, then the nucleus of what is left.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V): mass of the more likely tokens
        drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: kept
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from probabilities (B, V); returns (B,) ids.

    The exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is i with probability
    p_i. It is how ``torch.multinomial(probs, 1)`` draws too, so the same generator state gives the
    same ids, but without multinomial's validity checks of ``probs``: kernels every decoding step
    would pay (and on older PyTorch a host sync; gpt-fast samples this way for that reason).
    ``probs`` must be a distribution (softmax output); a zero-probability id is never drawn."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)  # (B, V)
    return torch.div(probs, race, out=race).argmax(dim=-1)  # in place, as multinomial divides


def next_tokens(logits: Tensor, *, greedy: bool = False, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row from logits (B, V); returns (B,) token ids."""
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if temperature < 1e-6:  # logits / temperature could overflow to inf: divide the gaps to the
        # row maximum (softmax is unchanged), in float64, where a temperature below float32's
        # normal range (1.2e-38) is not read as 0 when flush-to-zero is on (crtfastmath).
        gaps = logits - logits.amax(dim=-1, keepdim=True)  # (B, V), <= 0
        logits = (gaps.double() / temperature).float()
    else:
        logits = logits / temperature
    logits = filter_logits(logits, top_k=top_k, top_p=top_p)
    return sample(logits.softmax(dim=-1), generator)  # (B,)
