"""The paper's task: English-to-German translation with an encoder-decoder Transformer.

Reads a parallel corpus, learns a joint BPE vocabulary on its training side, batches by token count
and trains with label smoothing (paper 5.4); validation reports loss, perplexity, BLEU and chrF of
greedy output.

Legend: B batch, S source length, T target length, V vocabulary.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import TransformerConfig
from aiayn.data.batching import TranslationBatch, pair_batches
from aiayn.data.parallel import SentencePair, read_pairs, split_pairs
from aiayn.data.tokenizer import (BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, SubwordTokenizer)
from aiayn.models import Transformer
from aiayn.tasks.checkpoints import (Seq2SeqTokenizer, load_pretrained_tokenizer,
                                     save_pretrained_tokenizer)
from aiayn.tasks.pretrained import PretrainedModel
from aiayn.training.chunked_loss import projected_loss
from aiayn.training.devices import default_device
from aiayn.training.loss import label_smoothed_cross_entropy
from aiayn.training.weights import unwrap


def translation_loss(model: nn.Module, source: torch.Tensor, decoder_input: torch.Tensor,
                     targets: torch.Tensor, *, smoothing: float = 0.0, pad_id: int = PAD_ID
                     ) -> torch.Tensor:
    """The SUM of the label-smoothed cross-entropy of ``model`` over the non-pad ``targets`` (B, T)
    of right-padded ``source`` (B, S) and ``decoder_input`` (B, T): the training loss of the task.

    No target padding mask: under the causal mask real queries never see the right padding, and
    padded positions are ignored by the loss, so SDPA can take its causal kernel. A ``Transformer``
    scores its hidden states through ``projected_loss`` (chunked on the CPU); any other module (a
    DDP or compiled wrapper runs its own forward) through its logits.
    """
    source_mask = source != pad_id  # (B, S)
    if isinstance(model, Transformer):
        hidden = model.hidden_states(source, decoder_input,
                                     src_padding_mask=source_mask)  # (B, T, D)
        return projected_loss(hidden, model.generator, targets, smoothing=smoothing,
                              ignore_index=pad_id)
    logits = model(source, decoder_input, src_padding_mask=source_mask)  # (B, T, V)
    return label_smoothed_cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                        smoothing=smoothing, ignore_index=pad_id)


def check_pair_options(*, max_tokens: int, max_length: int, label_smoothing: float,
                       sentences: int, sentences_option: str) -> None:
    """The options of a pair task, checked before anything is trained (named as on the command
    line); ``sentences``: validation sentences decoded at each evaluation."""
    for option, value in (("--max-tokens", max_tokens), ("--max-length", max_length)):
        if value <= 0:
            raise ValueError(f"{option} must be positive, got {value}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
    if sentences < 0:
        raise ValueError(f"{sentences_option} must be non-negative, got {sentences}")


class PairBatches:
    """Training and validation batches, token count and loss of a task whose examples are id pairs
    (``train_source``/``train_target``, ``valid_source``/``valid_target``) with ``pad_id``,
    ``start_id`` and ``eos_id`` (and ``source_suffix``, ids after each source's </s>): the
    translation task, and text-to-text."""

    source_suffix: tuple[int, ...] = ()

    def _batches(self, sources, targets, *, shuffle: bool, seed: int
                 ) -> Iterator[TranslationBatch]:
        return pair_batches(sources, targets, max_tokens=self.max_tokens, shuffle=shuffle, seed=seed,
                            pad_id=self.pad_id, bos_id=self.start_id, eos_id=self.eos_id,
                            device=self.device, source_suffix=self.source_suffix)

    def train_batches(self, epoch: int) -> Iterator[TranslationBatch]:
        return self._batches(self.train_source, self.train_target, shuffle=True,
                             seed=self.seed * 100_003 + epoch)

    def valid_batches(self, max_length: int | None = None) -> Iterator[TranslationBatch]:
        """The validation pairs in fixed token-count batches; with ``max_length`` (the model's
        position table) only the pairs whose sides fit it with their </s> or <s>."""
        pairs = list(zip(self.valid_source, self.valid_target))
        if max_length is not None:
            pairs = [(s, t) for s, t in pairs
                     if max(len(s) + len(self.source_suffix), len(t)) < max_length]
        sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
        return self._batches(sources, targets, shuffle=False, seed=0)

    def count(self, batch: TranslationBatch) -> int:
        return batch.target_tokens

    def loss(self, model: nn.Module, batch: TranslationBatch, *, smoothing: float | None = None
             ) -> torch.Tensor:
        smoothing = self.label_smoothing if smoothing is None else smoothing
        return translation_loss(model, batch.source, batch.decoder_input, batch.targets,
                                smoothing=smoothing, pad_id=self.pad_id)

    def valid_loss(self, model: nn.Module) -> dict[str, float]:
        """Cross-entropy per target token over the validation pairs (no smoothing), and its ppl.

        A pair longer than the model's position table (training pairs are filtered by
        ``--max-length``, validation pairs are not) is left out rather than ending the run.
        """
        total, tokens = 0.0, 0
        for batch in self.valid_batches(getattr(unwrap(model).config, "position_limit", None)):
            total += float(self.loss(model, batch, smoothing=0.0))
            tokens += batch.target_tokens
        if not tokens:
            raise ValueError(f"no validation pair fits the model's position table "
                             f"(max_length={unwrap(model).config.max_length}); raise it with "
                             f"--set max_length=N")
        return {"loss": total / tokens, "ppl": math.exp(min(total / tokens, 50.0))}


class TranslationTask(PairBatches):
    """Translation from a TSV / two-file corpus (see ``aiayn.data.parallel``).

    Args:
        data: a TSV path, or a source and a target path.
        run_dir: the run directory (a tokenizer already saved there is reused on resume).
        vocab_size: joint BPE vocabulary size (paper: ~37000 for WMT; small data wants less).
        max_tokens: padded tokens per side per batch (paper: ~25000).
        max_length: training pairs with more subword tokens on a side are dropped.
        max_ratio: training pairs whose length ratio exceeds this are dropped (misalignments).
        label_smoothing: eps_ls (paper 5.4: 0.1).
        valid_bleu_sentences: validation sentences decoded for BLEU at each evaluation (0: none).
        seed: shuffling seed; device: where batches go.
        pretrained: a model to fine-tune (``--init``): its architecture, weights and tokenizer
            replace the preset and the BPE vocabulary learned here.
    """

    name = "translation"

    def __init__(self, data: Sequence[str | Path], *, run_dir: str | Path | None = None,
                 vocab_size: int = 8000, max_tokens: int = 4096, max_length: int = 128,
                 max_ratio: float = 3.0, label_smoothing: float = 0.1,
                 valid_bleu_sentences: int = 200, valid_fraction: float = 0.02,
                 test_fraction: float = 0.02, seed: int = 0, device: str | None = None,
                 pretrained: PretrainedModel | None = None):
        check_pair_options(max_tokens=max_tokens, max_length=max_length,
                           label_smoothing=label_smoothing, sentences=valid_bleu_sentences,
                           sentences_option="--valid-bleu-sentences")
        splits = split_pairs(read_pairs(list(data)), valid_fraction=valid_fraction,
                             test_fraction=test_fraction)
        if not splits["train"]:
            raise ValueError(f"{data[0]}: no training pairs")
        self.max_tokens, self.label_smoothing, self.seed = max_tokens, label_smoothing, seed
        self.device = torch.device(default_device(device))
        saved = Path(run_dir) / TOKENIZER_FILE if run_dir is not None else None
        self.pretrained = pretrained
        self.pad_id, self.start_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID
        if pretrained is not None:
            config = pretrained.config
            self.tokenizer = pretrained.tokenizer
            self.pad_id, self.eos_id = config.pad_id, config.eos_id
            pair = getattr(self.tokenizer, "language_ids", None)  # a language pair's codes
            self.start_id = config.decoder_start_id
            if pair is not None:
                self.source_suffix = pair.source_suffix
                if pair.decoder_start is not None:  # mBART: the decoder starts from [tgt_lang]
                    self.start_id = pair.decoder_start
            if config.position_limit is not None:  # room for </s> (and a suffix) in the table
                max_length = min(max_length, config.position_limit - 1 - len(self.source_suffix))
        elif saved is not None and saved.is_file() and (saved.parent / "checkpoints").is_dir():
            self.tokenizer = SubwordTokenizer.load(saved)  # resuming: the same ids
        else:
            texts = [p.source for p in splits["train"]] + [p.target for p in splits["train"]]
            self.tokenizer = SubwordTokenizer.train(texts, vocab_size=vocab_size)
        self.train_source, self.train_target = self._encode(splits["train"], max_length, max_ratio)
        if not self.train_source:
            raise ValueError(f"{data[0]}: no training pair is within max_length={max_length} tokens "
                             f"and max_ratio={max_ratio} (raise --max-length / --max-ratio)")
        self.filtered = len(splits["train"]) - len(self.train_source)
        self.max_length, self.max_ratio = max_length, max_ratio  # as applied (for messages)
        # tiny corpora, or a split column without valid rows: score on seen data, and say so
        valid = splits["valid"] or splits["train"][:200]
        self.valid_from_train = not splits["valid"]
        if self.valid_from_train:
            warnings.warn(f"{data[0]}: no validation pairs (a split column without 'valid' rows, "
                          f"or too few pairs for the 2 % hash split): validation scores the "
                          f"first {len(valid)} training pairs, which the model trains on",
                          RuntimeWarning, stacklevel=2)
        self.valid_pairs = valid
        self.valid_source, self.valid_target = self._encode(valid, None, None)
        self.valid_bleu_sentences = valid_bleu_sentences
        self.test_pairs = splits["test"]  # held out; scored by `aiayn evaluate --split test`

    def _encode(self, pairs: list[SentencePair], max_length: int | None, max_ratio: float | None
                ) -> tuple[list[list[int]], list[list[int]]]:
        sources = self.tokenizer.encode([p.source for p in pairs])
        targets = getattr(self.tokenizer, "encode_targets", self.tokenizer.encode)(
            [p.target for p in pairs])
        kept_source, kept_target = [], []
        for source, target in zip(sources, targets):
            if not source or not target:
                continue
            if max_length is not None and max(len(source), len(target)) > max_length:
                continue
            if max_ratio is not None and max(len(source), len(target)) > 5 and \
                    max(len(source), len(target)) > max_ratio * min(len(source), len(target)):
                continue
            kept_source.append(source)
            kept_target.append(target)
        return kept_source, kept_target

    # --- Task protocol ----------------------------------------------------------------------------
    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        if self.pretrained is not None:  # the checkpoint's architecture (--set still applies)
            return self.pretrained.config
        longest = max(max(map(len, self.train_source)), max(map(len, self.train_target)))
        return base.replace(vocab_size=self.tokenizer.vocab_size, src_vocab_size=None,
                            pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, decoder_start_id=None,
                            max_length=max(base.max_length, longest + 52))

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        model = Transformer(model_config)
        if self.pretrained is not None:
            model.load_state_dict(self.pretrained.weights)
        return model

    def metric_names(self) -> set[str]:
        """What ``evaluate`` reports: BLEU and chrF only when it decodes validation sentences."""
        return {"loss", "ppl"} | ({"bleu", "chrf"} if self.valid_bleu_sentences else set())

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        from aiayn.tasks.translate import language_options, score_translations, translate_ids

        metrics = self.valid_loss(model)
        count = min(self.valid_bleu_sentences, len(self.valid_pairs))
        if count:
            outputs = translate_ids(model, self.tokenizer.encode(
                [p.source for p in self.valid_pairs[:count]]), beam_size=1,
                **language_options(self.tokenizer))
            hypotheses = self.tokenizer.decode(outputs)
            metrics.update(score_translations(hypotheses,
                                              [p.target for p in self.valid_pairs[:count]]))
        return metrics

    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        if isinstance(self.tokenizer, Seq2SeqTokenizer):  # a checkpoint's: its files, as they are
            saved = save_pretrained_tokenizer(self.tokenizer, run_dir)
        else:
            self.tokenizer.save(Path(run_dir) / TOKENIZER_FILE)
            saved = {"tokenizer": TOKENIZER_FILE}
        return {**saved, "vocab_size": self.tokenizer.vocab_size,
                "train_pairs": len(self.train_source), "filtered_pairs": self.filtered,
                "valid_pairs": len(self.valid_pairs), "valid_from_train": self.valid_from_train,
                "init": self.pretrained.source if self.pretrained else None}

    @classmethod
    def load_assets(cls, run_dir: Path) -> SubwordTokenizer | Seq2SeqTokenizer:
        info = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
        config = TransformerConfig.from_dict(info["model_config"])
        return (load_pretrained_tokenizer(run_dir, info.get("assets") or {}, config)
                or SubwordTokenizer.load(Path(run_dir) / TOKENIZER_FILE))
