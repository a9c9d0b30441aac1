"""Label-smoothed cross-entropy (paper 5.4: epsilon_ls = 0.1), summed over real targets.

The smoothed target puts 1 - eps on the reference token and eps / V on every token (the reference
included), as in Szegedy et al. 2016 and ``torch.nn.functional.cross_entropy(label_smoothing=eps)``:
loss = (1 - eps) * (-log p[y]) + eps * mean_v(-log p[v]). Tokens with p[v] = 0 (a -inf logit) are
left out of the mean: smoothing towards an impossible token would make every loss infinite.

Legend: N targets, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def label_smoothed_cross_entropy(logits: Tensor, targets: Tensor, *, smoothing: float = 0.0,
                                 ignore_index: int = -100) -> Tensor:
    """The SUM over non-ignored targets of the label-smoothed negative log-likelihood.

    Args:
        logits: (N, V) unnormalised scores (any float dtype; computed in float32 at least).
        targets: (N,) token ids; positions equal to ``ignore_index`` contribute nothing.
        smoothing: eps in [0, 1).
        ignore_index: target value to skip (e.g. the padding id).

    Returns:
        A scalar tensor: the summed loss (divide by the number of real targets for a mean).

    Raises:
        ValueError: on mismatched shapes or a smoothing outside [0, 1).
    """
    if logits.dim() != 2 or targets.dim() != 1 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"expected logits (N, V) and targets (N,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    keep = targets != ignore_index  # (N,)
    # log_softmax subtracts the max first: finite for any finite logits, never log(0).
    log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
    nll = -log_probs.gather(1, targets.masked_fill(~keep, 0).unsqueeze(1)).squeeze(1)  # (N,)
    if smoothing > 0.0:
        # The smoothing mass goes to the tokens that are possible at all: a -inf logit (a token
        # masked out of the vocabulary, or one pushed to log 0 by extreme logits) would otherwise
        # make the loss infinite for every target (log 0 in the uniform term).
        impossible = log_probs == float("-inf")  # (N, V)
        possible = (log_probs.shape[-1] - impossible.sum(dim=-1)).clamp(min=1)  # (N,)
        uniform = -log_probs.masked_fill(impossible, 0.0).sum(dim=-1) / possible  # (N,)
        nll = (1.0 - smoothing) * nll + smoothing * uniform
    return nll.masked_fill(~keep, 0.0).sum()


def smoothed_nll_of_rows(log_normaliser: Tensor, target_logits: Tensor, mean_logits: Tensor | None,
                         keep: Tensor, smoothing: float) -> Tensor:
    """The summed loss of rows whose tokens are all possible, from per-row numbers, all (N,): log Z,
    z[y] and (with smoothing) mean_v z[v]. log p[v] = z[v] - log Z, so nll = log Z - z[y] and the uniform term is
    log Z - mean_v z[v]."""
    nll = log_normaliser - target_logits
    if smoothing > 0.0:
        nll = (1.0 - smoothing) * nll + smoothing * (log_normaliser - mean_logits)
    return nll.masked_fill(~keep, 0.0).sum()


def subtract_smoothed_targets(probabilities: Tensor, targets: Tensor, keep: Tensor,
                              smoothing: float) -> Tensor:
    """The gradient of ``smoothed_nll_of_rows`` w.r.t. the logits, from the softmax (N, V) (zero on ignored rows), in
    place: minus (1 - eps) at each target and eps / V everywhere, on the kept rows."""
    kept = keep.to(probabilities.dtype).unsqueeze(1)  # (N, 1)
    if smoothing > 0.0:
        probabilities.sub_(kept * (smoothing / probabilities.shape[-1]))
    return probabilities.scatter_add_(1, targets.unsqueeze(1), kept * -(1.0 - smoothing))
