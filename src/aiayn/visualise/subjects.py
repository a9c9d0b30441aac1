"""What ``aiayn attention`` looks at: a model plus a way to turn text into ids and token labels.

Sources, in order: a run directory (``load_run``: model, config, the task's tokenizer assets), or a
Hugging Face style directory (``config.json``) through ``aiayn.from_pretrained`` where this installation
has it, with the checkpoint's own tokenizer (``aiayn.interop.hf_tokenizer.load_tokenizer``). A tokenizer file given explicitly (``tokenizer.json`` of Hugging Face ``tokenizers`` or a
SentencePiece ``.model``) overrides the run's. Without any tokenizer the texts must be token ids.

Legend: T target length, S source length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from aiayn.models import Transformer
from aiayn.visualise.attention_report import Example


@dataclass
class Tokenizer:
    """Text -> ids (``encode``) and ids -> display labels (``labels``); ``adds_specials`` says that
    ``encode`` already adds the model's special tokens (BERT's [CLS]/[SEP] post-processor)."""

    encode: Callable[[str], list[int]]
    labels: Callable[[list[int]], list[str]]
    description: str
    adds_specials: bool = False


def tokenizer_from_object(obj: Any, description: str) -> Tokenizer | None:
    """Adapt a tokenizer object (``tokenizers.Tokenizer``, ``SentencePieceProcessor``, a Hugging Face
    ``PreTrainedTokenizer`` or anything with ``encode`` + a token lookup); None if unrecognised."""
    if obj is None:
        return None
    # Assets objects and dicts hold the tokenizer; the translation task's SubwordTokenizer wraps a
    # tokenizers.Tokenizer (its batch-only ``encode`` adds no specials, nor does ours below).
    for name in ("tokenizer", "tokenizers", "source_tokenizer", "backend", "_backend"):
        inner = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if inner is not None and inner is not obj:
            found = tokenizer_from_object(inner, description)
            if found is not None:
                return found
    if hasattr(obj, "id_to_token") and hasattr(obj, "encode") and hasattr(obj, "get_vocab_size"):
        # tokenizers.Tokenizer: its post-processor (if any) adds the special tokens.
        has_post = getattr(obj, "post_processor", None) is not None

        def encode(text: str) -> list[int]:
            encoding = obj.encode(text, add_special_tokens=has_post)
            # A tokenizer.json may enable padding (MiniLM's pads to 128): keep the real tokens only.
            return [i for i, real in zip(encoding.ids, encoding.attention_mask) if real]

        return Tokenizer(encode=encode,
                         labels=lambda ids: [obj.id_to_token(i) or f"<{i}>" for i in ids],
                         description=description, adds_specials=has_post)
    if hasattr(obj, "id_to_piece") and hasattr(obj, "encode"):  # SentencePiece
        return Tokenizer(encode=lambda text: list(obj.encode(text, out_type=int)),
                         labels=lambda ids: [obj.id_to_piece(int(i)) for i in ids],
                         description=description)
    if hasattr(obj, "convert_ids_to_tokens") and hasattr(obj, "encode"):  # transformers
        return Tokenizer(encode=lambda text: list(obj.encode(text)),
                         labels=lambda ids: list(obj.convert_ids_to_tokens(list(ids))),
                         description=description, adds_specials=True)
    symbols = getattr(obj, "symbols", None)
    if isinstance(symbols, list) and hasattr(obj, "encode"):  # the lm task's CharVocabulary
        return Tokenizer(encode=lambda text: list(obj.encode(text)),
                         labels=lambda ids: [symbols[int(i)] for i in ids], description=description)
    for lookup in ("id_to_token", "id_to_piece", "token"):
        if hasattr(obj, lookup) and hasattr(obj, "encode"):
            function = getattr(obj, lookup)
            return Tokenizer(encode=lambda text: list(obj.encode(text)),
                             labels=lambda ids: [str(function(int(i))) for i in ids],
                             description=description)
    return None


def tokenizer_from_file(path: str | Path) -> Tokenizer:
    """A ``tokenizers`` JSON file or a SentencePiece ``.model``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a file neither library can read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    if path.suffix == ".model":
        import sentencepiece

        try:
            processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as error:
            raise ValueError(f"{path}: not a SentencePiece model ({error})") from None
        return tokenizer_from_object(processor, f"SentencePiece {path}")
    from tokenizers import Tokenizer as HFTokenizer

    try:
        loaded = HFTokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own Exception type for bad JSON
        raise ValueError(f"{path}: not a tokenizers JSON file ({error})") from None
    return tokenizer_from_object(loaded, f"tokenizers {path}")


@dataclass
class Subject:
    """A model and how to make examples for it; ``missing`` lists what could not be found.
    ``translation``: a multilingual checkpoint's tokenizer set to a language pair
    (``aiayn.tasks.checkpoints.Seq2SeqTokenizer``), which then makes the ids as ``aiayn
    translate`` does."""

    model: nn.Module
    task: str
    tokenizer: Tokenizer | None
    source: str
    missing: list[str] = field(default_factory=list)
    translation: Any = None

    @property
    def encoder_decoder(self) -> bool:
        return isinstance(self.model, Transformer)

    def _ids(self, text: str, what: str) -> list[int]:
        """Token ids of ``text`` by the tokenizer, or the text read as ids when there is none."""
        if self.tokenizer is not None:
            ids = self.tokenizer.encode(text)
        else:
            try:
                ids = [int(token) for token in text.replace(",", " ").split()]
            except ValueError:
                raise ValueError(
                    f"{self.source} has no tokenizer ({'; '.join(self.missing) or 'none saved'}): "
                    f"give the {what} as token ids (e.g. '5 17 42') or pass --tokenizer FILE"
                ) from None
        if not ids:
            raise ValueError(f"the {what} {text!r} has no tokens")
        vocab = self.model.config.src_vocab_size if what == "source text" and \
            self.encoder_decoder else self.model.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"the {what} has token ids outside the vocabulary 0..{vocab - 1}: "
                             f"{bad[:5]}")
        return ids

    def _labels(self, ids: list[int]) -> list[str]:
        return self.tokenizer.labels(ids) if self.tokenizer is not None else [str(i) for i in ids]

    def example(self, text: str, target: str | None = None) -> Example:
        """Tokenise ``text`` (and ``target`` for an encoder-decoder model) as the model was trained.

        As the translation task trains: source + ``eos_id``; decoder input = ``decoder_start_id``
        (else ``bos_id``) + target, the target being the model's greedy translation when ``target``
        is None (so the last row is where the model looks when it predicts ``</s>``); with a
        language pair (``translation``), its codes where the checkpoint's format puts them, as
        ``aiayn translate`` and fine-tuning put them. Decoder-only
        and encoder-only models: the tokenizer's ids as they are (a tokenizer with a post-processor,
        e.g. BERT's, adds its own [CLS]/[SEP]).

        Raises:
            ValueError: untokenisable text, ids outside the vocabulary, a target for a model without a
                decoder input.
        """
        config = self.model.config
        if self.translation is not None and self.translation.languages:
            return self._language_example(text, target)
        specials = self.tokenizer is not None and self.tokenizer.adds_specials
        source = self._ids(text, "source text")
        if not self.encoder_decoder:
            if target is not None:
                raise ValueError(f"--target is for translation models; this is a {self.task} "
                                 "model (put the whole text in --text)")
            return Example(source, self._labels(source))
        if not specials and config.eos_id is not None and source[-1] != config.eos_id:
            source = source + [config.eos_id]
        start = config.decoder_start_id if config.decoder_start_id is not None else config.bos_id
        if start is None:
            raise ValueError("the model config has neither decoder_start_id nor bos_id: cannot "
                             "build the decoder input")
        if target is None:
            from aiayn.decoding.greedy import greedy_search

            ids = torch.tensor([source], dtype=torch.long)  # (1, S)
            real = torch.ones_like(ids, dtype=torch.bool)
            with torch.inference_mode():
                (hypothesis,) = greedy_search(self.model, ids, real)
            target_ids = [start] + hypothesis.tokens  # tokens exclude </s>
        else:
            target_ids = [start] + self._ids(target, "target text")
        return Example(source, self._labels(source), target_ids, self._labels(target_ids))

    def _language_example(self, text: str, target: str | None) -> Example:
        """``example`` for a language pair: the source with its codes (a prefix, or a suffix after
        </s>), the decoder input from the pair's start symbol and forced codes; without a target,
        ``aiayn translate``'s greedy translation (``translate_ids``)."""
        from aiayn.tasks.translate import language_options, translate_ids

        config, pair = self.model.config, self.translation.language_ids
        (tokens,) = self.translation.encode([text])
        if len(tokens) == len(pair.source_prefix):
            raise ValueError(f"the source text {text!r} has no tokens")
        source = tokens + [config.eos_id, *pair.source_suffix]
        start = config.decoder_start_id if pair.decoder_start is None else pair.decoder_start
        if target is None:
            with torch.inference_mode():
                (translation,) = translate_ids(self.model, [tokens], beam_size=1,
                                               **language_options(self.translation))
            target_ids = [start, *pair.forced] + translation  # the translation excludes </s>
        else:
            target_ids = [start] + self.translation.encode_targets([target])[0]
        return Example(source, self._labels(source), target_ids, self._labels(target_ids))


def load_subject(path: str | Path, *, tokenizer_file: str | Path | None = None,
                 src_lang: str | None = None, tgt_lang: str | None = None) -> Subject:
    """The model (and tokenizer) of a run directory or a Hugging Face style directory; for a
    multilingual translation checkpoint, or a run fine-tuned from one, set to the language pair
    ``src_lang`` / ``tgt_lang`` (a run's saved pair by default).

    Raises:
        FileNotFoundError: ``path`` missing.
        ValueError: neither a run nor a loadable Hugging Face directory (see ``load_run``); a
            multilingual checkpoint without both codes, an unknown code, or codes for a model
            without language codes (``aiayn.tasks.checkpoints.set_language_pair``).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no run or model directory at {path}")
    missing: list[str] = []
    tokenizer = translation = None
    if (path / "run.json").is_file() or not (path / "config.json").is_file():
        from aiayn.training.run import load_run

        try:
            run = load_run(path)
        except (ValueError, ImportError) as error:
            if "task class" not in str(error) and not isinstance(error, ImportError):
                raise
            run = load_run(path, load_assets=False)  # the task's code is not in this installation
            missing.append(f"the {path.name} task's assets could not be loaded ({error})")
        model, task = run.model, run.task
        translation = run.assets  # a Seq2SeqTokenizer where the run started from a checkpoint
        if run.assets is not None:
            tokenizer = tokenizer_from_object(run.assets, f"the {task} run's tokenizer")
            if tokenizer is None:
                missing.append(f"the {task} run's assets hold no tokenizer this command reads")
        elif not missing:
            missing.append(f"the {task} run saved no tokenizer")
        source = f"run {path}"
    else:
        import aiayn

        from_pretrained = getattr(aiayn, "from_pretrained", None)
        if from_pretrained is None:
            raise ValueError(f"{path} looks like a Hugging Face model directory, but this "
                             "installation has no aiayn.from_pretrained (the interop extra)")
        loaded = from_pretrained(path)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model.eval()
        task = type(model).__name__
        from aiayn.interop.hf_tokenizer import has_tokenizer, load_tokenizer

        if has_tokenizer(path):  # tokenizer.json, vocab.txt or Marian's SentencePiece files
            loaded_tokenizer = load_tokenizer(path)
            tokenizer = Tokenizer(encode=loaded_tokenizer.encode,
                                  labels=lambda ids: [loaded_tokenizer.id_to_token(i) for i in ids],
                                  description=f"the checkpoint's tokenizer ({path})",
                                  adds_specials=True)
            if isinstance(model, Transformer):  # where a multilingual checkpoint's codes go
                from aiayn.interop.hf_tokenizer import read_json_object
                from aiayn.tasks.checkpoints import Seq2SeqTokenizer

                model_type = read_json_object(path / "config.json").get("model_type")
                translation = Seq2SeqTokenizer(loaded_tokenizer, path,
                                               eos_id=model.config.eos_id, model_type=model_type)
        else:
            missing.append(f"{path} has no tokenizer files (tokenizer.json, vocab.txt, "
                           f"source.spm)")
        source = f"model {path}"
    if tokenizer_file is not None:
        tokenizer = tokenizer_from_file(tokenizer_file)
        missing, translation = [], None
    from aiayn.tasks.checkpoints import Seq2SeqTokenizer, set_language_pair

    if not isinstance(translation, Seq2SeqTokenizer):
        translation = None
        if src_lang is not None or tgt_lang is not None:
            given = "--tokenizer" if tokenizer_file is not None else f"the {task} model at {path}"
            raise ValueError(f"--src-lang / --tgt-lang apply to multilingual translation "
                             f"checkpoints (NLLB, M2M100, mBART) and runs fine-tuned from them, "
                             f"with their own tokenizer; not to {given}")
    else:
        set_language_pair(translation, path, src_lang, tgt_lang)
    return Subject(model=model, task=task, tokenizer=tokenizer, source=source, missing=missing,
                   translation=translation)
