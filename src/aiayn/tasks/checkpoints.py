"""What a command's RUN_DIR may be: an aiayn run directory or a Hugging Face checkpoint directory.

``load_model_dir`` returns a ``Run`` either way, so ``translate``, ``evaluate``, ``generate``,
``classify``, ``attention`` and ``embed`` read both alike. A checkpoint's task comes from the family
registry of ``aiayn.interop.hf`` (its config.json's ``architectures``), and its tokenizer files
(``tokenizer.json``, BERT's ``vocab.txt``, Marian's or M2M100's SentencePiece models) become the
assets that task's commands expect: the adapters below give a checkpoint's tokenizer the interface
of the tokenizers aiayn trains, with the ids the ``transformers`` tokenizer makes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiayn.training.run import RUN_FILE, Run

# aiayn.interop.hf model task -> the aiayn task whose commands serve it.
HF_TASKS = {"seq2seq": "translation", "causal_lm": "lm", "classification": "classification",
            "masked_lm": "mlm", "encoder": "encoder"}
TOKENIZER_DIR = "pretrained_tokenizer"  # where a run started from a checkpoint keeps its files
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte fallback (Llama 2's tokenizer)


class Seq2SeqTokenizer:
    """A checkpoint's tokenizer as the translation task uses one: ids without the final ``</s>``
    (the batcher appends it) and texts decoded without special tokens.

    Attributes:
        language_ids: where the codes of the language pair ``set_languages`` was given go
            (``aiayn.interop.hf_languages.LanguageIds``: a source prefix, a suffix after the
            source's </s>, the decoder's start symbol, tokens forced first); all empty when unset.
            ``translate_ids`` and the translation task's batches take them
            (``aiayn.tasks.translate.language_options``).
        languages: the codes ``set_languages`` was given, as a run saves them ({} when unset).
    """

    def __init__(self, tokenizer, directory: Path, *, eos_id: int, model_type: str | None = None):
        from aiayn.interop.hf_languages import LanguageIds

        self.tokenizer, self.directory, self.eos_id = tokenizer, Path(directory), eos_id
        self.model_type = model_type  # config.json's; marks an M2M100 / mBART tokenizer's family
        self.vocab_size = tokenizer.vocab_size
        self.language_ids = LanguageIds()
        self.languages: dict[str, str] = {}

    def set_languages(self, src_lang: str | None, tgt_lang: str | None, *,
                      model_type: str | None = None) -> None:
        """Translate from ``src_lang`` to ``tgt_lang`` (codes of a multilingual tokenizer: NLLB's
        ``eng_Latn``, M2M100's ``en``, mBART's ``en_XX``; see ``aiayn.interop.hf_languages``).
        Called with None, None it checks that the checkpoint needs no codes.

        Raises:
            ValueError: a multilingual checkpoint without both codes, an unknown code, or codes
                for a tokenizer without any.
        """
        from aiayn.interop.hf_languages import language_codes, language_ids

        self.model_type = model_type or self.model_type
        languages = language_codes(self.directory, model_type=self.model_type)
        self.language_ids = language_ids(languages, self.tokenizer, src_lang, tgt_lang)
        self.languages = ({"src_lang": src_lang, "tgt_lang": tgt_lang}
                          if languages.family is not None else {})

    def _strip(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] == self.eos_id else ids

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Source ids before their </s>: with a language pair set, the source prefix (if any) and
        the tokens (the batcher adds </s> and the source suffix); else the tokenizer's template
        without its final </s>."""
        if self.languages:
            prefix = list(self.language_ids.source_prefix)
            return [prefix + self.tokenizer.encode(text, add_special_tokens=False)
                    for text in texts]
        return [self._strip(self.tokenizer.encode(text)) for text in texts]

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        """Target-side ids, what the decoder reads after its start symbol and learns to write
        before </s>: with a language pair set, ``[tgt_lang] tokens`` (transformers' ``text_target``
        labels without their </s>) where the code is forced, the tokens where it is the start
        symbol (mBART); Marian's target SentencePiece model's ids; or as ``encode``."""
        if self.languages:
            forced = list(self.language_ids.forced)
            return [forced + self.tokenizer.encode(text, add_special_tokens=False)
                    for text in texts]
        if hasattr(self.tokenizer, "models"):
            return [self._strip(self.tokenizer.encode(text, target=True)) for text in texts]
        return self.encode(texts)

    def decode(self, rows: Sequence[Sequence[int]]) -> list[str]:
        return [self.tokenizer.decode([int(i) for i in row]) for row in rows]


class TextTokenizer:
    """A checkpoint's tokenizer as the language-model task uses one: ``encode(text)`` with the
    special tokens its ``transformers`` tokenizer adds by default (GPT-2: none), ``decode(ids)``."""

    def __init__(self, tokenizer, directory: Path):
        self.tokenizer, self.directory = tokenizer, Path(directory)

    def __len__(self) -> int:
        return self.tokenizer.vocab_size

    def encode(self, text: str, *, source: str = "text") -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of a conversation laid out by the tokenizer's chat template, ending with the
        opening of the assistant's turn: ``transformers``' ``apply_chat_template(messages,
        add_generation_prompt=True)`` (the template writes the special tokens itself).

        Raises:
            ValueError: the tokenizer has no chat template, or the template fails.
        """
        from aiayn.interop.hf_generation import render_chat, require_chat_template

        template = require_chat_template(self.directory)
        specials = {name: self.tokenizer.id_to_token(index)
                    for name, index in self.tokenizer.special_ids.items()}
        text = render_chat(template, messages, special_tokens=specials)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def pending_tokens(self, ids: Sequence[int]) -> int:
        """Length of the trailing run of byte-fallback tokens (``<0xE2>``...): their text may still
        change, since the decoder turns a run that is not valid UTF-8 into U+FFFD, byte by byte."""
        count = 0
        for index in reversed(ids):
            if not BYTE_PIECE.fullmatch(self.tokenizer.id_to_token(int(index))):
                break
            count += 1
        return count


def directory_task(path: str | Path) -> str:
    """The aiayn task of a run directory or a checkpoint directory ("encoder" for a bare BERT).

    Raises:
        FileNotFoundError: no such directory. ValueError: neither kind of directory, or a
            checkpoint aiayn does not load.
    """
    from aiayn.interop.hf import checkpoint_task
    from aiayn.training.run import read_run_info

    path = Path(path)
    if (path / RUN_FILE).is_file() or not (path / "config.json").is_file():
        if path.is_dir() and not (path / RUN_FILE).is_file():
            raise ValueError(f"{path} is not an aiayn run directory (no {RUN_FILE}) nor a Hugging "
                             f"Face checkpoint directory (no config.json)")
        return read_run_info(path)["task"]  # also: not found, not a directory, corrupt run.json
    return HF_TASKS[checkpoint_task(path)]


def set_languages(run: Run, src_lang: str | None, tgt_lang: str | None) -> None:
    """Point a translation ``Run``'s tokenizer at a language pair: ``set_language_pair``."""
    set_language_pair(run.assets, run.path, src_lang, tgt_lang)


def set_language_pair(assets: Any, path: Path, src_lang: str | None, tgt_lang: str | None
                      ) -> None:
    """Point the translation assets of the model directory ``path`` at a language pair
    (``Seq2SeqTokenizer.set_languages``). A run fine-tuned from a multilingual checkpoint keeps
    the pair it trained on (run.json): there each code is optional, and one given replaces that
    side.

    Raises:
        ValueError: as ``Seq2SeqTokenizer.set_languages``; codes given for a run with aiayn's own
            tokenizer.
    """
    if isinstance(assets, Seq2SeqTokenizer):
        saved = assets.languages
        assets.set_languages(src_lang or saved.get("src_lang"), tgt_lang or saved.get("tgt_lang"))
    elif src_lang is not None or tgt_lang is not None:
        raise ValueError(f"{path}: --src-lang / --tgt-lang apply to multilingual Hugging Face "
                         f"checkpoints (NLLB, M2M100, mBART-50, mBART) and runs fine-tuned from "
                         f"them, not to a run with aiayn's own tokenizer")


def load_model_dir(path: str | Path, *, task: str | None = None, model_task: str | None = None
                   ) -> Run:
    """A run directory (``load_run``) or a checkpoint directory (``from_pretrained``), as a ``Run``
    with its task's assets, model on the CPU in eval mode.

    Args:
        task: the aiayn task the caller serves; a directory of another task is an error.
        model_task: for a checkpoint, build this ``aiayn.interop.hf`` task instead of its own (e.g.
            ``"encoder"`` to embed with a BERT checkpoint that has a head).

    Raises:
        FileNotFoundError / ValueError: as ``directory_task``, ``load_run`` and ``from_pretrained``;
            a directory of another task; a checkpoint without the tokenizer files its task needs.
    """
    from aiayn.training.run import load_run

    path = Path(path)
    name = directory_task(path)
    if (path / RUN_FILE).is_file():
        return load_run(path, task=task)
    if task is not None and name != task:
        raise ValueError(f"{path} is a Hugging Face checkpoint for {name!r}, not {task!r} (its "
                         f"config.json: architectures)")
    from aiayn.interop.hf import from_pretrained

    model = from_pretrained(path, task=model_task)
    return Run(path=path, task=name, model_config=model.config, training_config={}, model=model,
               assets=checkpoint_assets(path, name, model.config),
               info={"task": name, "source": f"hugging face {path}"}, weights=None)


def checkpoint_assets(path: Path, task: str, config) -> Any:
    """The assets a run of ``task`` would hold, made from a checkpoint's tokenizer files."""
    from aiayn.interop.hf_tokenizer import (has_tokenizer, load_tokenizer, read_json_object,
                                            require_fast_tokenizer)

    path = Path(path)
    require_fast_tokenizer(path)
    if not has_tokenizer(path):
        raise ValueError(f"{path}: no tokenizer files (tokenizer.json, vocab.txt, Marian's "
                         f"source.spm / target.spm / vocab.json, or M2M100's "
                         f"sentencepiece.bpe.model / vocab.json); commands need the checkpoint's "
                         f"tokenizer next to its weights")
    if task == "translation":
        model_type = read_json_object(path / "config.json").get("model_type")
        return Seq2SeqTokenizer(load_tokenizer(path), path, eos_id=config.eos_id,
                                model_type=model_type if isinstance(model_type, str) else None)
    if task == "lm":
        return TextTokenizer(load_tokenizer(path), path)
    from aiayn.data.wordpiece import WordPieceTokenizer

    tokenizer = WordPieceTokenizer.from_pretrained_dir(path)
    if task == "classification":
        from aiayn.data.labels import LabelMap
        from aiayn.tasks.classification import ClassificationAssets

        return ClassificationAssets(tokenizer=tokenizer, labels=LabelMap(checkpoint_labels(path)),
                                    max_tokens=config.max_length)
    from aiayn.tasks.masked_lm import MaskedLMAssets

    return MaskedLMAssets(tokenizer=tokenizer, max_tokens=sentence_length(path, config.max_length))


def checkpoint_labels(path: Path) -> tuple[str, ...]:
    """Class names of a classifier checkpoint, in output order (config.json ``id2label``)."""
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    labels = config.get("id2label") or {}
    try:
        names = [labels[key] for key in sorted(labels, key=int)]
    except (TypeError, ValueError):
        raise ValueError(f"{path / 'config.json'}: id2label keys must be class indices") from None
    return tuple(names) or tuple(f"LABEL_{i}" for i in range(config.get("num_labels", 2)))


def sentence_length(path: Path, default: int) -> int:
    """Tokens per text for an encoder checkpoint: sentence-transformers' ``max_seq_length``
    (sentence_bert_config.json) where the checkpoint has one, else ``default``."""
    settings = Path(path) / "sentence_bert_config.json"
    if settings.is_file():
        value = json.loads(settings.read_text(encoding="utf-8")).get("max_seq_length")
        if isinstance(value, int) and value >= 3:
            return min(value, default)
    return default


def save_pretrained_tokenizer(tokenizer, run_dir: Path) -> dict[str, Any]:
    """Copy a checkpoint tokenizer's files into ``run_dir``; the assets entry that names them (and
    a translation tokenizer's language pair, with the checkpoint's model_type)."""
    from aiayn.interop.hf_tokenizer import copy_tokenizer_files

    files = copy_tokenizer_files(tokenizer.directory, Path(run_dir) / TOKENIZER_DIR)
    saved = {"tokenizer": TOKENIZER_DIR, "tokenizer_files": files}
    if getattr(tokenizer, "languages", None):
        saved["languages"] = {**tokenizer.languages, "model_type": tokenizer.model_type}
    return saved


def load_pretrained_tokenizer(run_dir: Path, assets: dict[str, Any], config):
    """The tokenizer adapter a run started from a checkpoint saved (None for aiayn's own), set to
    the language pair it was trained on."""
    if assets.get("tokenizer") != TOKENIZER_DIR:
        return None
    from aiayn.interop.hf_tokenizer import load_tokenizer

    directory = Path(run_dir) / TOKENIZER_DIR
    if not (config.n_encoder_layers and config.n_decoder_layers):
        return TextTokenizer(load_tokenizer(directory), directory)
    languages = assets.get("languages") or {}
    tokenizer = Seq2SeqTokenizer(load_tokenizer(directory), directory, eos_id=config.eos_id,
                                 model_type=languages.get("model_type"))
    if languages:
        tokenizer.set_languages(languages.get("src_lang"), languages.get("tgt_lang"))
    return tokenizer
