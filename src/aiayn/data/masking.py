"""BERT's masked-LM corruption (Devlin et al. 2019, section 3.1, "Task #1: Masked LM").

15% of the maskable tokens of each sequence are chosen as prediction targets; of those, 80% are
replaced by ``[MASK]``, 10% by a random token and 10% are left unchanged, so the model cannot rely on
seeing ``[MASK]`` at fine-tuning time. Special tokens and padding are never chosen. As in BERT's
reference ``create_pretraining_data.py``, the number of targets per sequence is
``max(1, round(0.15 * maskable))`` (exact per sequence rather than a Bernoulli draw per token), so no
sequence is without a target.

Legend: B batch, T length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100  # label of positions that are not prediction targets


@dataclass(frozen=True, kw_only=True)
class MaskingRule:
    """BERT's proportions. ``probability`` of maskable tokens become targets; of the targets,
    ``mask_share`` get [MASK], ``random_share`` a random token, the rest stay unchanged."""

    probability: float = 0.15
    mask_share: float = 0.8
    random_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.probability <= 1.0:
            raise ValueError(f"probability must be in (0, 1], got {self.probability!r}")
        for name in ("mask_share", "random_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.mask_share + self.random_share > 1.0:
            raise ValueError(f"mask_share + random_share must be at most 1, got "
                             f"{self.mask_share + self.random_share!r}")


def mask_tokens(ids: Tensor, maskable: Tensor, *, mask_id: int, random_ids: Tensor,
                generator: torch.Generator, rule: MaskingRule = MaskingRule()
                ) -> tuple[Tensor, Tensor]:
    """Corrupt a batch for masked-LM training.

    Args:
        ids: (B, T) token ids.
        maskable: (B, T) bool, True where a token may be chosen (False at special tokens and padding).
        mask_id: the ``[MASK]`` id.
        random_ids: (K,) ids a random replacement is drawn from (the non-special vocabulary).
        generator: the random stream (a private generator makes batches reproducible).
        rule: the proportions.

    Returns:
        (inputs (B, T), labels (B, T)): the corrupted ids, and the original id at each target
        position with ``IGNORE_INDEX`` (-100) everywhere else.

    Raises:
        ValueError: shapes that differ, or no random ids.
    """
    if ids.shape != maskable.shape or ids.dim() != 2:
        raise ValueError(f"ids and maskable must both be (B, T), got {tuple(ids.shape)} and "
                         f"{tuple(maskable.shape)}")
    if random_ids.numel() == 0:
        raise ValueError("random_ids is empty")
    device = ids.device
    maskable = maskable.bool()
    counts = maskable.sum(dim=1)  # (B,)
    targets_per_row = torch.where(
        counts > 0, (counts.double() * rule.probability).round().long().clamp(min=1), 0)
    # Choose exactly targets_per_row[b] maskable positions per row: rank random scores, with
    # non-maskable positions scored above every maskable one so they rank last.
    scores = torch.rand(ids.shape, generator=generator, device=device)
    scores = scores.masked_fill(~maskable, 2.0)
    order = scores.argsort(dim=1)  # (B, T) positions by increasing score
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(ids.shape[1], device=device).expand_as(order))
    chosen = (ranks < targets_per_row.unsqueeze(1)) & maskable  # (B, T)

    draw = torch.rand(ids.shape, generator=generator, device=device)
    to_mask = chosen & (draw < rule.mask_share)
    to_random = chosen & (draw >= rule.mask_share) & (draw < rule.mask_share + rule.random_share)
    replacement = random_ids.to(device)[
        torch.randint(random_ids.numel(), ids.shape, generator=generator, device=device)]
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    inputs = torch.where(to_random, replacement, inputs)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    return inputs, labels
