"""Decoder-only language modelling as a ``Task`` of the training engine.

Data: one plain text file, split into the first ``1 - valid_fraction`` of the characters for
training and the rest for validation (nanoGPT's tiny-Shakespeare split), or nanoGPT's prepared
directory (``train.bin`` + ``val.bin``). The vocabulary is one of:

- characters (the default): the sorted characters of the text;
- a byte-level BPE learned on the training split (``tokenizer="bpe"``, ``aiayn.data.byte_bpe``);
- a Hugging Face tokenizer directory (``tokenizer=DIR``, e.g. GPT-2's), or the tokenizer of the
  checkpoint being fine-tuned (``pretrained``).

The ids (characters' and subwords') are written once to token files in the run directory and
memory-mapped (``aiayn.data.token_files``), so the corpus need not fit in memory; a resumed run
reuses them.
Training batches are windows at random offsets (nanoGPT's ``get_batch``), ``batches_per_epoch`` per
epoch, drawn from a generator seeded by (seed, epoch) so a resumed run sees the same batches.
Validation covers the WHOLE validation split once, in contiguous non-overlapping blocks (not a
random sample).

Metrics: loss (nats per token), perplexity, bits per character (``bpc``: the summed loss in bits
over the characters predicted; = loss / ln 2 for characters) and, for subword vocabularies,
``bits_per_token``. nanoGPT's files do not say how many characters they hold: no ``bpc``.

Legend: B batch, T block length (context), V vocabulary.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.data.chunked_encoding import EncodeBatch
from aiayn.data.text import (VALID_FRACTION, CharVocabulary, check_length, contiguous_blocks,
                             random_blocks, token_slice)
from aiayn.data.token_files import TokenFiles, tokenizer_fingerprint
from aiayn.models import CausalLM
from aiayn.models.modes import evaluating
from aiayn.tasks.checkpoints import TextTokenizer, load_pretrained_tokenizer, save_pretrained_tokenizer
from aiayn.tasks.pretrained import PretrainedModel
from aiayn.training.chunked_loss import chunks_loss, projected_loss
from aiayn.training.devices import default_device
from aiayn.training.process_group import is_rank_zero, wait_for_rank_zero
from aiayn.training.run import RUN_FILE, check_same_assets


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
    # The logits as they are, as nanoGPT's: CUDA autocast then runs a bf16 log-softmax and a float32
    # NLL (a float32 cast here doubles that (B * T, V) traffic); the losses are summed in float32.
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")  # (B * T,)
    return losses.float().sum()


@torch.no_grad()
def evaluate_ids(model: nn.Module, ids: Tensor | np.ndarray, *, block_size: int,
                 batch_size: int = 64, device: torch.device | str = "cpu",
                 characters: int | None = None) -> dict[str, float]:
    """Loss, perplexity and bits per character of ``model`` on every next-token target of ``ids``
    (a tensor or a memory-mapped array).

    Every target is predicted once, from the tokens before it in its block (contiguous
    non-overlapping blocks of ``block_size``), so the figure is exact and repeatable.

    Args:
        characters: None: ``ids`` are characters, ``bpc`` = loss / ln 2. Else the number of
            characters the predicted tokens (all but the first) spell: ``bpc`` is the summed loss
            in bits over them, and ``bits_per_token`` = loss / ln 2 is reported beside it;
            0 (unknown, e.g. nanoGPT's files): ``bits_per_token`` only.
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with evaluating(model):
        for inputs, targets in contiguous_blocks(ids, block_size=block_size,
                                                 batch_size=batch_size):
            total += token_loss(model, inputs.to(device), targets.to(device)).double()
            count += targets.numel()
    loss = total.item() / count
    metrics = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": float(count)}
    if characters is None:
        return {**metrics, "bpc": loss / math.log(2)}
    metrics["bits_per_token"] = loss / math.log(2)
    if characters:
        metrics["bpc"] = total.item() / math.log(2) / characters
    return metrics


def batch_encoder(vocabulary: CharVocabulary | TextTokenizer) -> EncodeBatch:
    """How a text's chunks become token ids (``aiayn.data.token_files``): characters by a
    vectorised lookup, a tokenizer's subwords without special tokens."""
    if isinstance(vocabulary, CharVocabulary):
        return lambda texts: [vocabulary.ids(text) for text in texts]
    backend = vocabulary.tokenizer  # aiayn.interop.hf_tokenizer.PretrainedTokenizer
    return lambda texts: backend.encode_batch(texts, add_special_tokens=False)


def vocabulary_fingerprint(vocabulary: CharVocabulary | TextTokenizer) -> str:
    """What identifies a vocabulary in ``tokens.json``: token files made with another are remade."""
    if isinstance(vocabulary, CharVocabulary):
        symbols = json.dumps(vocabulary.symbols, ensure_ascii=False)
        return f"char:{tokenizer_fingerprint(symbols)}"
    return tokenizer_fingerprint(vocabulary.tokenizer._tokenizer.to_str())


def predicted_characters(vocabulary, ids: Tensor | np.ndarray, characters: int | None) -> int:
    """Characters spelt by all tokens of ``ids`` but the first (which is never predicted), given
    ``characters`` spelt by all of them; 0 when unknown (None)."""
    if not characters:
        return 0
    return characters - len(vocabulary.decode(token_slice(ids, 0, 1).tolist()))


class LanguageModelTask:
    """Next-token prediction on a plain text file or nanoGPT's token files (see the module
    docstring).

    Args:
        data: path of a UTF-8 text file, or of a directory holding nanoGPT's ``train.bin`` and
            ``val.bin`` (uint16 ids; needs ``tokenizer=DIR`` or ``pretrained``, the tokenizer
            that made them).
        batch_size: blocks per training batch (nanoGPT's ``batch_size``).
        block_size: context length T; None: the preset's ``max_length``.
        valid_fraction: the last fraction of the text held out for validation.
        batches_per_epoch: training batches per epoch (None: about one pass over the training text).
        eval_batch_size: blocks per validation forward pass.
        seed: seeds the batch sampler.
        device: where batches go (None: cuda if available, else cpu).
        pretrained: a model to fine-tune (``--init``): its architecture, weights and tokenizer
            replace the preset and the vocabulary.
        tokenizer: None: characters; ``"bpe"``: a byte-level BPE of ``vocab_size`` entries learned
            on the training split; or a Hugging Face tokenizer directory (``tokenizer.json``).
        vocab_size: the size of the BPE vocabulary to learn (``tokenizer="bpe"`` only).
        run_dir: where the token files (``tokens/``) and a learned tokenizer go, and are found
            again on resume; None: kept in memory (and the tokenizer in a temporary directory).

    Raises:
        FileNotFoundError / IsADirectoryError / ValueError: unreadable or empty text, options that
            do not fit together, and (once the context is known) a split shorter than the context.
    """

    name = "lm"
    TOKENS_DIR = "tokens"

    def __init__(self, data: str | Path, *, batch_size: int = 12, block_size: int | None = None,
                 valid_fraction: float = VALID_FRACTION, batches_per_epoch: int | None = None,
                 eval_batch_size: int = 64, seed: int = 0, device: str | None = None,
                 pretrained: PretrainedModel | None = None, tokenizer: str | Path | None = None,
                 vocab_size: int | None = None, run_dir: str | Path | None = None):
        for field, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field, value in (("block_size", block_size), ("batches_per_epoch", batches_per_epoch)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if pretrained is not None and tokenizer is not None:
            raise ValueError("a fine-tuned model keeps its own tokenizer: give --tokenizer or "
                             "--init, not both")
        if (vocab_size is not None) != (tokenizer == "bpe"):
            raise ValueError("--vocab-size sets the size of a learned BPE vocabulary: give it "
                             "with --tokenizer bpe (and only then)")
        self.path = Path(data)
        self.pretrained, self.tokenizer_kind = pretrained, self._kind(tokenizer, pretrained)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.valid_fraction = valid_fraction
        self.train_characters = self.valid_characters = None
        if self.path.is_dir():
            self._from_token_directory(tokenizer)
        elif self.tokenizer_kind == "char":
            self._from_characters()
        else:
            self._from_subwords(tokenizer, vocab_size)
        self.batch_size, self.block_size = batch_size, block_size
        self.batches_per_epoch = batches_per_epoch
        self.eval_batch_size, self.seed = eval_batch_size, seed
        self.device = torch.device(default_device(device))

    @staticmethod
    def _kind(tokenizer: str | Path | None, pretrained: PretrainedModel | None) -> str:
        if pretrained is not None:
            return "char" if isinstance(pretrained.tokenizer, CharVocabulary) else "pretrained"
        if tokenizer is None:
            return "char"
        return "bpe" if str(tokenizer) == "bpe" else "tokenizer"

    def _from_characters(self) -> None:
        """The text's characters as ids in token files, as subwords are (``_token_files``): the
        vocabulary is the text's sorted characters, or the fine-tuned checkpoint's."""
        from aiayn.data.text import text_lines
        from aiayn.data.token_files import count_characters

        count_characters(self.path)  # an empty or unreadable text is an error before anything
        self.vocabulary = (self.pretrained.tokenizer if self.pretrained
                           else CharVocabulary.from_lines(text_lines(self.path)))
        self._token_files()

    def _from_token_directory(self, tokenizer: str | Path | None) -> None:
        from aiayn.data.token_files import TRAIN_FILE, VALID_FILE

        if not any((self.path / name).is_file() for name in (TRAIN_FILE, VALID_FILE)):
            raise IsADirectoryError(f"{self.path}: is a directory, not a text file, and holds no "
                                    f"token files (nanoGPT's {TRAIN_FILE} and {VALID_FILE})")
        if self.tokenizer_kind in ("char", "bpe"):
            raise ValueError(f"{self.path} is a directory: token files (nanoGPT's train.bin and "
                             f"val.bin) are read with the tokenizer that made them; give it with "
                             f"--tokenizer DIR (or --init a checkpoint that has it)")
        self.vocabulary = self._subword_vocabulary(tokenizer, None)
        self.tokens = TokenFiles.open_nanogpt(self.path, vocab_size=len(self.vocabulary))
        self.train_ids, self.valid_ids = self.tokens.train, self.tokens.valid

    def _subword_vocabulary(self, tokenizer: str | Path | None, vocab_size: int | None
                            ) -> TextTokenizer:
        from aiayn.interop.hf_tokenizer import load_tokenizer

        if self.pretrained is not None:
            return self.pretrained.tokenizer
        if self.tokenizer_kind == "tokenizer":
            directory = Path(tokenizer)
            if not directory.is_dir():
                raise FileNotFoundError(f"--tokenizer: no such directory: {directory} (give "
                                        f"'bpe' or a directory with a tokenizer.json)")
            if not (directory / "tokenizer.json").is_file():
                raise ValueError(f"--tokenizer: {directory} has no tokenizer.json (a Hugging Face "
                                 f"fast tokenizer, e.g. GPT-2's)")
            return TextTokenizer(load_tokenizer(directory), directory)
        return self._learned_bpe(vocab_size)

    def _learned_bpe(self, vocab_size: int) -> TextTokenizer:
        """The run's BPE vocabulary: the one saved in the run directory (a resumed run), else one
        learned on the training split and saved there (by rank 0 under torchrun)."""
        import sys
        import tempfile

        from aiayn.data.byte_bpe import learn_byte_bpe, save_byte_bpe
        from aiayn.data.token_files import count_characters, split_lines
        from aiayn.interop.hf_tokenizer import load_tokenizer
        from aiayn.tasks.checkpoints import TOKENIZER_DIR

        directory = (self.run_dir / TOKENIZER_DIR if self.run_dir is not None
                     else Path(tempfile.mkdtemp(prefix="aiayn-bpe-")))
        resumed = (directory / "tokenizer.json").is_file()
        if is_rank_zero() and not resumed:
            cut = int(count_characters(self.path) * (1.0 - self.valid_fraction))
            lines = split_lines(self.path, cut)[0]  # the training split's

            def training_text() -> Iterator[list[str]]:  # 1,000 lines at a time
                while batch := list(itertools.islice(lines, 1000)):
                    yield batch

            save_byte_bpe(learn_byte_bpe(training_text(), vocab_size=vocab_size), directory)
        wait_for_rank_zero()
        vocabulary = TextTokenizer(load_tokenizer(directory), directory)
        if len(vocabulary) != vocab_size and is_rank_zero():
            reason = ("the run's saved vocabulary has another size" if resumed
                      else "the training text has no more pairs seen twice to merge")
            print(f"aiayn train lm: warning: the BPE vocabulary has {len(vocabulary)} entries, "
                  f"not {vocab_size}: {reason}", file=sys.stderr)
        return vocabulary

    def _from_subwords(self, tokenizer: str | Path | None, vocab_size: int | None) -> None:
        self.vocabulary = self._subword_vocabulary(tokenizer, vocab_size)
        self._token_files()
        self.train_characters, self.valid_characters = (self.tokens.train_characters,
                                                        self.tokens.valid_characters)

    def _token_files(self) -> None:
        """The text's ids in token files (``run_dir/tokens``, reused when made from the same file
        and vocabulary; written by rank 0 under torchrun), or in memory without a run directory."""
        tokenizer_id = vocabulary_fingerprint(self.vocabulary)
        made_of = {"valid_fraction": self.valid_fraction, "tokenizer": tokenizer_id}

        def write(directory: Path | None) -> TokenFiles:
            return TokenFiles.write(self.path, encode_batch=batch_encoder(self.vocabulary),
                                    vocab_size=len(self.vocabulary), tokenizer_id=tokenizer_id,
                                    valid_fraction=self.valid_fraction, directory=directory)

        if self.run_dir is None:
            tokens = write(None)
        else:
            directory = self.run_dir / self.TOKENS_DIR
            if is_rank_zero() and not self._saved_tokens(directory, made_of):
                if (self.run_dir / RUN_FILE).is_file():  # a run resumed on another text: its
                    check_same_assets(self.run_dir, self)  # vocabulary must be the run's first
                write(directory)
            wait_for_rank_zero()
            tokens = TokenFiles.open(directory)
        self.tokens = tokens
        self.train_ids, self.valid_ids = tokens.train, tokens.valid

    def _saved_tokens(self, directory: Path, made_of: dict[str, Any]) -> bool:
        """Whether ``directory`` holds complete token files of this text and tokenizer."""
        from aiayn.data.token_files import INFO_FILE, data_fingerprint

        if not (directory / INFO_FILE).is_file():
            return False
        try:
            tokens = TokenFiles.open(directory)
        except (FileNotFoundError, ValueError):
            return False
        return tokens.matches({**made_of, **data_fingerprint(self.path)})

    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        """The preset with this text's vocabulary; the context is ``block_size`` (or the preset's).
        A subword vocabulary trained from scratch is padded to a multiple of 64 entries (nanoGPT's
        50,304 for GPT-2's 50,257): the extra rows are never a target."""
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
        size = len(self.vocabulary)
        if self.tokenizer_kind != "char":
            size = -(-size // 64) * 64
        # Characters have no special tokens; id 0 only fills pad columns that are never attended
        # (a BPE's id 0 is <|endoftext|>, or the tokenizer's first entry).
        return base.replace(vocab_size=size, src_vocab_size=size, max_length=block, pad_id=0,
                            bos_id=0, eos_id=0, decoder_start_id=0, n_encoder_layers=0)

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
            1, len(self.train_ids) // (self.batch_size * self.block_size))
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
        names = {"loss", "ppl", "tokens"}
        if self.tokenizer_kind != "char":
            names.add("bits_per_token")
        if self.tokenizer_kind == "char" or self.valid_characters is not None:
            names.add("bpc")
        return names

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        characters = None
        if self.tokenizer_kind != "char":
            characters = predicted_characters(self.vocabulary, self.valid_ids,
                                              self.valid_characters)
        return evaluate_ids(model, self.valid_ids, block_size=self.block_size,
                            batch_size=self.eval_batch_size, device=self.device,
                            characters=characters)

    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        common = {"size": len(self.vocabulary), "data": str(self.path),
                  "valid_fraction": self.valid_fraction,
                  "init": self.pretrained.source if self.pretrained else None}
        if isinstance(self.vocabulary, TextTokenizer):  # its files, as they are
            kind = "pretrained" if self.pretrained else self.tokenizer_kind  # or bpe, tokenizer
            return {**save_pretrained_tokenizer(self.vocabulary, run_dir), "kind": kind, **common}
        self.vocabulary.save(run_dir)
        return {"vocabulary": CharVocabulary.FILE, "kind": "char", **common}

    @classmethod
    def load_assets(cls, run_dir: Path) -> CharVocabulary | TextTokenizer:
        info = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
        config = TransformerConfig.from_dict(info["model_config"])
        return (load_pretrained_tokenizer(run_dir, info.get("assets") or {}, config)
                or CharVocabulary.load(run_dir))
