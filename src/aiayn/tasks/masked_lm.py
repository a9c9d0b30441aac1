"""Masked-LM pretraining of an encoder (BERT, Devlin et al. 2019, section 3.1).

Each text becomes ``[CLS] pieces [SEP]``; every batch is corrupted afresh by BERT's 15% / 80-10-10
rule (``aiayn.data.masking``) from a generator seeded by (seed, epoch), so batches are reproducible
and a resumed run sees the same corruption. The loss is the summed cross-entropy over the chosen
positions only (the loss units); the vocabulary projection runs on those positions only, not on all
B*T. Validation uses one fixed corruption of the validation texts: loss, perplexity and accuracy of
the masked-token predictions.

Legend: B batch, T longest length in the batch, N chosen positions, V vocabulary.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.data.sequence_batches import bucketed_batches, pad_right
from aiayn.data.masking import IGNORE_INDEX, MaskingRule, mask_tokens
from aiayn.data.wordpiece import TOKENIZER_FILE, WordPieceTokenizer
from aiayn.models.encoder_only import MaskedLM


def masked_lm_loss(model: nn.Module, inputs: Tensor, labels: Tensor,
                   padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy over the chosen positions (``labels`` (B, T) not -100) of corrupted
    ``inputs`` (B, T), and how many of them the model predicts right.

    A ``MaskedLM`` projects the hidden states of the chosen positions only; any other module (a DDP
    or compiled wrapper runs its own forward) through its (B, T, V) logits.
    """
    chosen = labels != IGNORE_INDEX  # (B, T)
    if isinstance(model, MaskedLM):
        hidden = model.hidden_states(inputs, padding_mask=padding_mask)  # (B, T, D)
        logits = model.head(hidden[chosen]).float()  # (N, V)
    else:
        logits = model(inputs, padding_mask=padding_mask)[chosen].float()  # (N, V)
    targets = labels[chosen]  # (N,)
    loss = nn.functional.cross_entropy(logits, targets, reduction="sum")
    return loss, (logits.argmax(-1) == targets).sum()


@dataclass
class MaskedBatch:
    """inputs (B, T) corrupted ids, padding_mask (B, T), labels (B, T) original id or -100;
    ``targets`` = number of chosen positions (counted on the CPU)."""

    inputs: Tensor
    padding_mask: Tensor
    labels: Tensor
    targets: int


@dataclass
class MaskedLMAssets:
    """What evaluating a masked-LM run needs: its tokenizer, sequence length and the masking it
    was trained and validated with (BERT's where the run does not say)."""

    tokenizer: WordPieceTokenizer
    max_tokens: int
    rule: MaskingRule = field(default_factory=MaskingRule)


class MaskedLMTask:
    """``aiayn.training.Task`` for masked-LM pretraining.

    Args:
        train / valid: texts.
        tokenizer: WordPiece tokenizer with [MASK].
        max_tokens: ids per sequence at most.
        batch_size: sequences per batch.
        seed: batch order and masking seed (with the epoch).
        device: where batches go.
        rule: masking proportions (BERT's by default).
        data_info: described in run.json.
    """

    name = "mlm"

    def __init__(self, *, train: Sequence[str], valid: Sequence[str],
                 tokenizer: WordPieceTokenizer, max_tokens: int = 128, batch_size: int = 32,
                 seed: int = 0, device: str | torch.device = "cpu",
                 rule: MaskingRule = MaskingRule(), data_info: dict[str, Any] | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not train or not valid:
            raise ValueError(f"masked LM needs training and validation texts, got {len(train)} "
                             f"and {len(valid)}")
        self.tokenizer, self.max_tokens, self.batch_size = tokenizer, max_tokens, batch_size
        self.seed, self.device, self.rule = seed, torch.device(device), rule
        self.data_info = data_info or {}
        self.train_ids = tokenizer.encode(train, max_length=max_tokens)
        self.valid_ids = tokenizer.encode(valid, max_length=max_tokens)
        special = torch.tensor(sorted(set(tokenizer.special_ids)))
        everything = torch.arange(tokenizer.vocab_size)
        self.random_ids = everything[~torch.isin(everything, special)]
        self.special_ids = special
        # one fixed corruption of the validation set, so validation losses are comparable
        generator = torch.Generator().manual_seed(seed + 7919)
        self.valid_batches = [self._batch([self.valid_ids[i] for i in rows], generator)
                              for rows in bucketed_batches([len(s) for s in self.valid_ids],
                                                           batch_size=batch_size)]

    def _batch(self, sequences: Sequence[Sequence[int]], generator: torch.Generator
               ) -> MaskedBatch:
        ids, mask = pad_right(sequences, self.tokenizer.pad_id)
        maskable = mask & ~torch.isin(ids, self.special_ids)  # never [CLS], [SEP], padding
        inputs, labels = mask_tokens(ids, maskable, mask_id=self.tokenizer.mask_id,
                                     random_ids=self.random_ids, generator=generator,
                                     rule=self.rule)
        return MaskedBatch(inputs=inputs.to(self.device), padding_mask=mask.to(self.device),
                           labels=labels.to(self.device),
                           targets=int((labels != IGNORE_INDEX).sum()))

    # --- model ----------------------------------------------------------------------------------
    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        return base.replace(vocab_size=self.tokenizer.vocab_size, src_vocab_size=None,
                            pad_id=self.tokenizer.pad_id,
                            max_length=max(base.max_length, self.max_tokens))

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        return MaskedLM(model_config)

    # --- training -------------------------------------------------------------------------------
    def train_batches(self, epoch: int) -> Iterator[MaskedBatch]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        lengths = [len(ids) for ids in self.train_ids]
        for rows in bucketed_batches(lengths, batch_size=self.batch_size, rng=rng):
            yield self._batch([self.train_ids[i] for i in rows], generator)

    def count(self, batch: MaskedBatch) -> int:
        return batch.targets

    def loss(self, model: nn.Module, batch: MaskedBatch) -> Tensor:
        return masked_lm_loss(model, batch.inputs, batch.labels, batch.padding_mask)[0]

    def metric_names(self) -> set[str]:
        return {"loss", "ppl", "accuracy"}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        total, hits, count = 0.0, 0, 0
        for batch in self.valid_batches:
            loss, correct = masked_lm_loss(model, batch.inputs, batch.labels,
                                           batch.padding_mask)
            total += float(loss)
            hits += int(correct)
            count += batch.targets
        mean = total / max(count, 1)
        return {"loss": mean, "ppl": float(torch.tensor(min(mean, 50.0)).exp()),
                "accuracy": hits / max(count, 1)}

    # --- assets ---------------------------------------------------------------------------------
    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        self.tokenizer.save(Path(run_dir) / TOKENIZER_FILE)
        return {"tokenizer": TOKENIZER_FILE, "max_tokens": self.max_tokens,
                "masking": {"probability": self.rule.probability,
                            "mask_share": self.rule.mask_share,
                            "random_share": self.rule.random_share}, **self.data_info}

    @classmethod
    def load_assets(cls, run_dir: Path) -> MaskedLMAssets:
        run_dir = Path(run_dir)
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("assets", {})
        return MaskedLMAssets(
            tokenizer=WordPieceTokenizer.load(run_dir / info.get("tokenizer", TOKENIZER_FILE)),
            max_tokens=int(info.get("max_tokens", 128)),
            rule=MaskingRule(**info.get("masking", {})))
