"""The tokenizer that comes with a Hugging Face checkpoint, through the ``tokenizers`` library.

``tokenizer.json`` (any model: BERT WordPiece, GPT-2 byte-level BPE, ...) is loaded as is; a BERT
directory with only ``vocab.txt`` gets the standard BERT WordPiece pipeline (lower-casing from
``tokenizer_config.json``'s ``do_lower_case``); a Marian directory (``source.spm``, ``target.spm``,
``vocab.json``) gets ``aiayn.interop.hf_marian_tokenizer``, an M2M100 directory
(``sentencepiece.bpe.model``, ``vocab.json``) ``aiayn.interop.hf_m2m100_tokenizer``. Padding and
truncation stored in ``tokenizer.json`` (all-MiniLM-L6-v2 pads every text to 128) are switched off:
aiayn builds its own padding masks. Decoding skips special tokens and, where
``tokenizer_config.json`` asks for it (``clean_up_tokenization_spaces``), removes the spaces before
punctuation as ``transformers`` 5 does: not for a BPE model (GPT-2, Llama), whose decoded text
already has its real spaces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiayn.data.wordpiece import BERT_SPECIAL_TOKENS

# Every file a tokenizer may be made of; ``copy_tokenizer_files`` carries them into a run directory,
# with the checkpoint's generation settings (a run fine-tuned from it generates as it did).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "source.spm", "target.spm", "target_vocab.json",
                   "sentencepiece.bpe.model", "chat_template.jinja", "generation_config.json")
SPECIAL_TOKENS = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token", "bos_token",
                  "eos_token")


def read_json_object(path: Path) -> dict[str, Any]:
    """A settings file of a checkpoint directory: {} when absent or not an object; ValueError
    naming the file when it is not JSON."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    return data if isinstance(data, dict) else {}


class PretrainedTokenizer:
    """Text <-> token ids with a checkpoint's vocabulary.

    Attributes:
        special_ids: e.g. ``{"pad_token": 0, "cls_token": 101, ...}`` for the special tokens named in
            ``special_tokens_map.json`` / ``tokenizer_config.json`` that the vocabulary holds.
    """

    def __init__(self, tokenizer, special_tokens: dict[str, str], *, clean_up: bool = False):
        self._tokenizer = tokenizer
        self.clean_up = clean_up
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.special_ids = {name: tokenizer.token_to_id(token) for name, token in special_tokens.items()
                            if tokenizer.token_to_id(token) is not None}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int | None:
        return self.special_ids.get("pad_token")

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text (with [CLS] ... [SEP] or the model's template by default)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) leaves out the offsets: the same ids, less memory
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]

    def tokens(self, text: str, *, add_special_tokens: bool = True) -> list[str]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens

    def id_to_token(self, index: int) -> str:
        return self._tokenizer.id_to_token(int(index)) or f"<{index}>"

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        text = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.clean_up else text


def bert_vocab_tokenizer(directory: str | Path):
    """The ``tokenizers.Tokenizer`` of a BERT directory with ``vocab.txt`` and no
    ``tokenizer.json``, as ``transformers``' ``BertTokenizerFast`` builds it: its
    ``tokenizer_config.json`` settings (``do_lower_case``, ``strip_accents``,
    ``tokenize_chinese_chars``) and its special tokens registered (a "[SEP]" in a text is one id;
    decoding skips them)."""
    from tokenizers.implementations import BertWordPieceTokenizer

    directory = Path(directory)
    settings = read_json_object(directory / "tokenizer_config.json")
    specials = {**BERT_SPECIAL_TOKENS, **special_tokens(directory)}
    accents = settings.get("strip_accents")
    return BertWordPieceTokenizer(
        str(directory / "vocab.txt"), lowercase=bool(settings.get("do_lower_case", True)),
        strip_accents=None if accents is None else bool(accents),
        handle_chinese_chars=bool(settings.get("tokenize_chinese_chars", True)),
        **{name: specials[name] for name in BERT_SPECIAL_TOKENS})._tokenizer


def cleans_up(settings: dict[str, Any], tokenizer) -> bool:
    """Whether decoding removes the spaces before punctuation: ``tokenizer_config.json`` asks
    for it, and the model is not BPE (transformers 5 leaves a BPE model's text as decoded, whose
    spaces are real) unless the config forces it."""
    return bool(settings.get("clean_up_tokenization_spaces", False)) and (
        type(tokenizer.model).__name__ != "BPE" or bool(settings.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))


def clean_up_tokenization(text: str) -> str:
    """``transformers``' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                     (" 're", "'re")):
        text = text.replace(old, new)
    return text


def require_fast_tokenizer(path: str | Path) -> None:
    """Raise when a directory holds a SentencePiece ``spm.model`` (DeBERTa-v2/v3's) without the
    ``tokenizer.json`` that aiayn reads: converting one needs transformers and sentencepiece.

    Raises:
        ValueError: saying how to write the ``tokenizer.json``.
    """
    directory = Path(path)
    if (directory / "spm.model").is_file() and not (directory / "tokenizer.json").is_file():
        raise ValueError(f"{directory}: spm.model but no tokenizer.json; aiayn reads a "
                         f"SentencePiece vocabulary from the fast tokenizer's tokenizer.json: "
                         f"write one with transformers' fast tokenizer, e.g. "
                         f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) (needs "
                         f"sentencepiece installed)")


def has_tokenizer(path: str | Path) -> bool:
    """Whether ``path`` holds tokenizer files ``load_tokenizer`` reads."""
    directory = Path(path)
    return any((directory / name).is_file()
               for name in ("tokenizer.json", "vocab.txt", "source.spm")) or \
        is_m2m100_directory(directory)


def is_m2m100_directory(path: str | Path) -> bool:
    """Whether ``path`` holds M2M100's own tokenizer: ``sentencepiece.bpe.model`` and
    ``vocab.json``, with ``M2M100Tokenizer`` as ``tokenizer_class`` if it names one (Speech2Text
    ships the same two files)."""
    directory = Path(path)
    if not ((directory / "sentencepiece.bpe.model").is_file()
            and (directory / "vocab.json").is_file()):
        return False
    name = read_json_object(directory / "tokenizer_config.json").get("tokenizer_class")
    return name is None or name == "M2M100Tokenizer"


def copy_tokenizer_files(source: str | Path, destination: str | Path) -> list[str]:
    """Copy a checkpoint's tokenizer files into ``destination`` (created); returns their names.
    A ``sentencepiece.bpe.model`` beside a ``tokenizer.json`` (XLM-R, NLLB, mBART) is left: only
    M2M100's own tokenizer reads it."""
    import shutil

    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    same = source.resolve() == destination.resolve()  # e.g. a BPE learned into the run directory
    unread = {"sentencepiece.bpe.model"} if (source / "tokenizer.json").is_file() else set()
    copied = []
    for name in TOKENIZER_FILES:
        if name not in unread and (source / name).is_file():
            if not same:
                shutil.copyfile(source / name, destination / name)
            copied.append(name)
    return copied


def special_tokens(directory: str | Path) -> dict[str, str]:
    """The special tokens a checkpoint directory names (``SPECIAL_TOKENS`` -> token text):
    ``tokenizer_config.json``'s, overridden by ``special_tokens_map.json``'s, as ``transformers``
    reads them."""
    directory = Path(directory)
    settings = read_json_object(directory / "tokenizer_config.json")
    specials = {name: value for name, value in settings.items()
                if name in SPECIAL_TOKENS and isinstance(value, str)}
    for name, value in read_json_object(directory / "special_tokens_map.json").items():
        if name in SPECIAL_TOKENS:
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                specials[name] = value
    return specials


def additional_special_tokens(directory: str | Path) -> list[str]:
    """The extra special tokens a checkpoint directory lists (multilingual checkpoints' language
    codes): ``tokenizer_config.json``'s ``additional_special_tokens`` (transformers 5:
    ``extra_special_tokens``), then ``special_tokens_map.json``'s, without repeats."""
    directory = Path(directory)
    settings = read_json_object(directory / "tokenizer_config.json")
    tokens: list[str] = []
    for listed in (settings.get("additional_special_tokens"), settings.get("extra_special_tokens"),
                   read_json_object(directory / "special_tokens_map.json")
                   .get("additional_special_tokens")):
        for token in listed if isinstance(listed, list) else []:
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str) and token not in tokens:
                tokens.append(token)
    return tokens


def load_tokenizer(path: str | Path):
    """The tokenizer of an HF checkpoint directory: ``tokenizer.json``, else BERT's ``vocab.txt``,
    else Marian's ``source.spm`` / ``target.spm`` / ``vocab.json`` (a ``MarianTokenizer``), else
    M2M100's ``sentencepiece.bpe.model`` / ``vocab.json`` (an ``M2M100Tokenizer``).

    Raises:
        FileNotFoundError: the directory has neither file.
        ValueError: a file is malformed.
    """
    from tokenizers import Tokenizer

    directory = Path(path)
    require_fast_tokenizer(directory)
    settings = read_json_object(directory / "tokenizer_config.json")
    specials = special_tokens(directory)
    tokenizer_file, vocab_file = directory / "tokenizer.json", directory / "vocab.txt"
    if tokenizer_file.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{tokenizer_file}: not a readable tokenizer ({error})") from None
    elif vocab_file.is_file():
        for name, default in BERT_SPECIAL_TOKENS.items():
            specials.setdefault(name, default)
        tokenizer = bert_vocab_tokenizer(directory)
    elif (directory / "source.spm").is_file():
        from aiayn.interop.hf_marian_tokenizer import MarianTokenizer

        return MarianTokenizer(directory)
    elif is_m2m100_directory(directory):
        from aiayn.interop.hf_m2m100_tokenizer import M2M100Tokenizer

        return M2M100Tokenizer(directory)
    else:
        raise FileNotFoundError(f"{directory}: no tokenizer found (looked for tokenizer.json, "
                                f"vocab.txt, Marian's source.spm and M2M100's "
                                f"sentencepiece.bpe.model + vocab.json)")
    return PretrainedTokenizer(tokenizer, specials, clean_up=cleans_up(settings, tokenizer))
