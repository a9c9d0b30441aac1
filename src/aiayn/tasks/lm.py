"""Decoder-only language modelling as a ``Task`` of the training engine.

Data: one plain text file, character vocabulary, split into the first ``1 - valid_fraction`` of the
characters for training and the rest for validation (nanoGPT's tiny-Shakespeare split). Training
batches are windows at random offsets (nanoGPT's ``get_batch``), ``batches_per_epoch`` per epoch, drawn
from a generator seeded by (seed, epoch) so a resumed run sees the same batches. Validation covers the
WHOLE validation split once, in contiguous non-overlapping blocks (not a random sample).

Metrics: loss (nats per token), perplexity, and bits per character (= loss / ln 2 for characters).

Legend: B batch, T block length (context), V vocabulary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.data.text import (VALID_FRACTION, CharVocabulary, check_length, contiguous_blocks,
                             random_blocks, read_text, split_text)
from aiayn.models import CausalLM
from aiayn.models.modes import evaluating
from aiayn.tasks.checkpoints import TextTokenizer, load_pretrained_tokenizer, save_pretrained_tokenizer
from aiayn.tasks.pretrained import PretrainedModel
from aiayn.training.chunked_loss import chunks_loss, projected_loss
from aiayn.training.devices import default_device


def token_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    """Summed next-token cross-entropy of inputs (B, T) against targets (B, T).

    The loss path is chosen for the device: on the CPU a ``CausalLM``'s hidden states are projected
    and scored in row chunks (``aiayn.training.chunked_loss``); elsewhere, and for any other module
    (a DDP or compiled wrapper runs its own forward), the logits go to ``F.cross_entropy``.
    """
    if isinstance(model, CausalLM):
        hidden = model.hidden_states(inputs)  # (B, T, D)
        if chunks_loss(hidden):
            return projected_loss(hidden, model.lm_head, targets)
        logits = model.lm_head(hidden)  # (B, T, V)
    else:
        logits = model(inputs)  # (B, T, V)
    # As nanoGPT computes it (autocast runs the cross-entropy in float32, for both); the per-token
    # losses are summed in float32.
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # (B * T,)
    return losses.float().sum()


@torch.no_grad()
def evaluate_ids(model: nn.Module, ids: Tensor, *, block_size: int, batch_size: int = 64,
                 device: torch.device | str = "cpu") -> dict[str, float]:
    """Loss, perplexity and bits per character of ``model`` on every next-token target of ``ids``.

    Every target is predicted once, from the tokens before it in its block (contiguous
    non-overlapping blocks of ``block_size``), so the figure is exact and repeatable.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with evaluating(model):
        for inputs, targets in contiguous_blocks(ids, block_size=block_size,
                                                 batch_size=batch_size):
            total += token_loss(model, inputs.to(device), targets.to(device)).double()
            count += targets.numel()
    loss = total.item() / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bpc": loss / math.log(2),
            "tokens": float(count)}


class LanguageModelTask:
    """Next-character prediction on a plain text file (see the module docstring).

    Args:
        data: path of a UTF-8 text file.
        batch_size: blocks per training batch (nanoGPT's ``batch_size``).
        block_size: context length T; None: the preset's ``max_length``.
        valid_fraction: the last fraction of the text held out for validation.
        batches_per_epoch: training batches per epoch (None: about one pass over the training text).
        eval_batch_size: blocks per validation forward pass.
        seed: seeds the batch sampler.
        device: where batches go (None: cuda if available, else cpu).
        pretrained: a model to fine-tune (``--init``): its architecture, weights and tokenizer
            replace the preset and the character vocabulary.

    Raises:
        FileNotFoundError / IsADirectoryError / ValueError: unreadable or empty text, and (once the
            context is known) a split shorter than the context.
    """

    name = "lm"

    def __init__(self, data: str | Path, *, batch_size: int = 12, block_size: int | None = None,
                 valid_fraction: float = VALID_FRACTION, batches_per_epoch: int | None = None,
                 eval_batch_size: int = 64, seed: int = 0, device: str | None = None,
                 pretrained: PretrainedModel | None = None):
        for field, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field, value in (("block_size", block_size), ("batches_per_epoch", batches_per_epoch)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        self.path = Path(data)
        text = read_text(self.path)
        self.pretrained = pretrained
        self.vocabulary = pretrained.tokenizer if pretrained else CharVocabulary.from_text(text)
        train_text, valid_text = split_text(text, valid_fraction)
        self.valid_fraction = valid_fraction
        where = str(self.path)
        self.train_ids = torch.tensor(self.vocabulary.encode(train_text, source=where),
                                      dtype=torch.long)
        self.valid_ids = torch.tensor(self.vocabulary.encode(valid_text, source=where),
                                      dtype=torch.long)
        self.batch_size, self.block_size = batch_size, block_size
        self.batches_per_epoch = batches_per_epoch
        self.eval_batch_size, self.seed = eval_batch_size, seed
        self.device = torch.device(default_device(device))

    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        """The preset with this text's vocabulary; the context is ``block_size`` (or the preset's)."""
        if self.pretrained is not None:  # the checkpoint's architecture (--set still applies)
            base = self.pretrained.config
            if self.block_size is not None and self.block_size > base.max_length:
                raise ValueError(f"--block-size {self.block_size} exceeds the pretrained model's "
                                 f"context of {base.max_length} positions")
        block = self.block_size or base.max_length
        self.block_size = block
        check_length(self.train_ids, block, f"training part of {self.path}")
        check_length(self.valid_ids, block, f"validation part of {self.path}")
        if self.pretrained is not None:
            return base
        # Characters have no special tokens; id 0 only fills pad columns that are never attended.
        return base.replace(vocab_size=len(self.vocabulary), src_vocab_size=len(self.vocabulary),
                            max_length=block, pad_id=0, bos_id=0, eos_id=0, decoder_start_id=0,
                            n_encoder_layers=0)

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        model = CausalLM(model_config)
        if self.pretrained is not None:
            model.load_state_dict(self.pretrained.weights)
        return model

    def train_batches(self, epoch: int) -> Iterator[tuple[Tensor, Tensor]]:
        if self.block_size is None:
            raise ValueError("call model_config() first: it fixes the context length")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        batches = self.batches_per_epoch or max(
            1, self.train_ids.numel() // (self.batch_size * self.block_size))
        non_blocking = self.device.type == "cuda"
        for inputs, targets in random_blocks(self.train_ids, block_size=self.block_size,
                                             batch_size=self.batch_size, batches=batches,
                                             generator=generator):
            yield (inputs.to(self.device, non_blocking=non_blocking),
                   targets.to(self.device, non_blocking=non_blocking))

    def count(self, batch: tuple[Tensor, Tensor]) -> int:
        return batch[1].numel()

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return token_loss(model, *batch)

    def metric_names(self) -> set[str]:
        return {"loss", "ppl", "bpc", "tokens"}

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return evaluate_ids(model, self.valid_ids, block_size=self.block_size,
                            batch_size=self.eval_batch_size, device=self.device)

    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        if isinstance(self.vocabulary, TextTokenizer):  # a checkpoint's: its files, as they are
            return {**save_pretrained_tokenizer(self.vocabulary, run_dir), "kind": "pretrained",
                    "size": len(self.vocabulary), "data": str(self.path),
                    "valid_fraction": self.valid_fraction, "init": self.pretrained.source}
        self.vocabulary.save(run_dir)
        return {"vocabulary": CharVocabulary.FILE, "kind": "char", "size": len(self.vocabulary),
                "data": str(self.path), "valid_fraction": self.valid_fraction,
                "init": self.pretrained.source if self.pretrained else None}

    @classmethod
    def load_assets(cls, run_dir: Path) -> CharVocabulary | TextTokenizer:
        info = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
        config = TransformerConfig.from_dict(info["model_config"])
        return (load_pretrained_tokenizer(run_dir, info.get("assets") or {}, config)
                or CharVocabulary.load(run_dir))
