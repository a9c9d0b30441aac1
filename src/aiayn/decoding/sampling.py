"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus) and min-p
sampling, and the repetition penalty.

Legend: B batch, V vocabulary, L tokens so far.
"""

from __future__ import annotations

import torch
from torch import Tensor


def penalise_repeats(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """The repetition penalty of Keskar et al. 2019 (CTRL), as ``transformers`` applies it: the
    logit of every id in ``seen`` (B, L) is divided by ``penalty`` where positive and multiplied by
    it where negative, so > 1 makes repeats less likely. Logits (B, V) -> (B, V)."""
    scores = logits.gather(-1, seen)  # (B, L)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(-1, seen, scores)


def filter_logits(logits: Tensor, *, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> Tensor:
    """Logits (B, V) with -inf outside the top-k set, outside the top-p nucleus and below min-p.

    top-k keeps the k largest logits (ties at the k-th value are kept). top-p keeps the smallest set of
    most likely tokens whose probability mass reaches ``top_p`` (Holtzman et al. 2020); the most likely
    token is always kept. min-p keeps the tokens at least ``min_p`` times as likely as the most
    likely one (Nguyen et al. 2024). Together, in that order, each on what the one before left.
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
    if min_p is not None and min_p > 0:
        probs = logits.softmax(dim=-1)  # (B, V)
        floor = min_p * probs.amax(dim=-1, keepdim=True)  # (B, 1)
        logits = logits.masked_fill(probs < floor, float("-inf"))  # the likeliest stays
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
                top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
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
    logits = filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    return sample(logits.softmax(dim=-1), generator)  # (B,)
