"""M2M100's own tokenizer (facebook/m2m100_418M, m2m100_1.2B): ``sentencepiece.bpe.model`` plus
the ids of ``vocab.json``, as ``transformers.M2M100Tokenizer`` uses them (the shared SentencePiece
part: ``aiayn.interop.hf_sentencepiece``). These checkpoints ship no ``tokenizer.json``.

    ids      0 .. len(vocab.json) - 1   the pieces (fairseq's order: <s> <pad> </s> <unk> ...)
             len(vocab.json) + i        ``__xx__``, the i-th code of the language set
                                        (``language_codes``: "m2m100", 100 codes; "wmt21", 8)
    source   [__src__] pieces </s>      ``get_lang_id`` gives the codes' ids, whether or not
    target   </s> [__tgt__] ...         the tokenizer files list the codes

The 8 "madeup words" after the codes (``num_madeup_words``) have rows in the model but no token:
an id the tokenizer does not know decodes to ``<unk>``, as in transformers.

Encoding splits the text at the special tokens (``<s> <pad> </s> <unk>`` and the listed
``additional_special_tokens``: the codes, in facebook/m2m100_*'s special_tokens_map.json), leftmost
and longest first as transformers' ``Trie.split``; a special token is one id, the rest goes through
the SentencePiece model, a piece ``vocab.json`` lacks being ``<unk>``. Decoding skips the ids of
those special tokens; the other ids become tokens, runs of pieces are joined by the SentencePiece
model and a special token left (``<unk>`` for an unknown id) is written as is
(``M2M100Tokenizer.convert_tokens_to_string``). A code the files do not list (a tokenizer saved
by ``M2M100Tokenizer(vocab, spm).save_pretrained``) is no special token to transformers: kept in a
decoded text, not split out of a source text; aiayn does the same. Spaces before punctuation are
removed where ``tokenizer_config.json`` sets ``clean_up_tokenization_spaces`` (transformers 5 keeps
them when the file does not say; transformers 4 removes them).
"""

from __future__ import annotations

import re
from pathlib import Path

from aiayn.interop.hf_sentencepiece import load_model, piece_ids, read_json
from aiayn.interop.hf_tokenizer import (additional_special_tokens, clean_up_tokenization,
                                        read_json_object, special_tokens)

SPM, VOCAB = "sentencepiece.bpe.model", "vocab.json"
# transformers' FAIRSEQ_LANGUAGE_CODES (tokenization_m2m_100.py): the order fixes the ids
LANGUAGE_SETS = {
    "m2m100": tuple(
        "af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl "
        "gu ha he hi hr ht hu hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml "
        "mn mr ms my ne nl no ns oc or pa pl ps pt ro ru sd si sk sl so sq sr ss su sv sw ta th tl "
        "tn tr uk ur uz vi wo xh yi yo zh zu".split()),
    "wmt21": ("en", "ha", "is", "ja", "cs", "ru", "zh", "de"),
}
DEFAULTS = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "pad_token": "<pad>",
            "unk_token": "<unk>"}  # M2M100Tokenizer's


def language_tokens(directory: str | Path) -> tuple[str, ...]:
    """The ``__xx__`` tokens of an M2M100 tokenizer directory, in id order.

    Raises:
        ValueError: ``tokenizer_config.json``'s ``language_codes`` names no known set.
    """
    directory = Path(directory)
    name = read_json_object(directory / "tokenizer_config.json").get("language_codes", "m2m100")
    if name not in LANGUAGE_SETS:
        raise ValueError(f"{directory / 'tokenizer_config.json'}: language_codes {name!r} is not "
                         f"one of {', '.join(LANGUAGE_SETS)}")
    return tuple(f"__{code}__" for code in LANGUAGE_SETS[name])


class M2M100Tokenizer:
    """Text <-> ids with an M2M100 checkpoint's SentencePiece model and vocabulary.

    Same interface as ``aiayn.interop.hf_tokenizer.PretrainedTokenizer``; ``encode`` with special
    tokens writes ``[__src__] pieces </s>`` for the ``src_lang`` of ``tokenizer_config.json``
    (``en`` when it names none, as transformers).

    Raises:
        FileNotFoundError: ``sentencepiece.bpe.model`` or ``vocab.json`` is missing. ValueError: a
            file is unreadable, ``vocab.json`` lacks the unknown or end token, or the language set
            is unknown.
    """

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        for name in (SPM, VOCAB):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}: missing (an M2M100 tokenizer needs "
                                        f"{SPM} and {VOCAB})")
        self.vocabulary: dict[str, int] = read_json(directory / VOCAB)
        if not isinstance(self.vocabulary, dict):
            raise ValueError(f"{directory / VOCAB}: not a token -> id object")
        names = {**DEFAULTS, **special_tokens(directory)}
        missing = [names[name] for name in ("unk_token", "eos_token")
                   if names[name] not in self.vocabulary]
        if missing:
            raise ValueError(f"{directory / VOCAB}: no entry for {', '.join(missing)}")
        languages = language_tokens(directory)
        self.language_ids = {token: len(self.vocabulary) + i for i, token in enumerate(languages)}
        self._tokens = {index: token for token, index in self.vocabulary.items()}
        self._tokens.update({index: token for token, index in self.language_ids.items()})
        self.unk_token = names["unk_token"]
        self.special_ids = {name: self.token_to_id(token) for name, token in names.items()
                            if self.token_to_id(token) is not None}
        # transformers' special tokens: the named ones and the listed extra ones (the codes)
        self.special_tokens = set(names.values()) | set(additional_special_tokens(directory))
        self._skipped = {self.token_to_id(token) for token in self.special_tokens} - {None}
        self._split = re.compile("(" + "|".join(
            re.escape(token) for token in sorted(self.special_tokens, key=len, reverse=True)) + ")")
        settings = read_json_object(directory / "tokenizer_config.json")
        self.clean_up = bool(settings.get("clean_up_tokenization_spaces", False))
        self.src_lang = str(settings.get("src_lang") or "en")  # encode's default source
        self.model = load_model(directory / SPM, "M2M100")

    @property
    def vocab_size(self) -> int:
        """The ids the tokenizer has: the pieces and the language codes."""
        return len(self.vocabulary) + len(self.language_ids)

    @property
    def pad_id(self) -> int | None:
        return self.special_ids.get("pad_token")

    def token_to_id(self, token: str) -> int | None:
        """A piece's or a code's id (``__fr__``); None for a token the tokenizer lacks."""
        return self.language_ids.get(token, self.vocabulary.get(token))

    def id_to_token(self, index: int) -> str:
        return self._tokens.get(int(index), self.unk_token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Ids of one text: ``[__src__] pieces </s>`` by default, the pieces alone without."""
        unk = self.vocabulary[self.unk_token]
        ids: list[int] = []
        for part in self._split.split(text):  # odd parts: the special tokens
            if part in self.special_tokens:
                index = self.token_to_id(part)
                ids.append(unk if index is None else index)
            elif part:
                ids += piece_ids(self.model.encode(part, out_type=str), self.vocabulary, unk)
        if not add_special_tokens:
            return ids
        code = self.token_to_id(f"__{self.src_lang}__")
        if code is None:
            raise ValueError(f"src_lang {self.src_lang!r} of tokenizer_config.json is not a "
                             f"language code of this M2M100 tokenizer")
        return [code, *ids, self.special_ids["eos_token"]]

    def tokens(self, text: str, *, add_special_tokens: bool = True) -> list[str]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return [self.id_to_token(i) for i in ids]

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        text, pieces = "", []
        for index in ids:
            if skip_special_tokens and int(index) in self._skipped:
                continue
            token = self.id_to_token(index)
            if token in self.special_tokens:  # not a piece: written as is
                text, pieces = text + self.model.decode(pieces) + token, []
            else:
                pieces.append(token)
        text = (text + self.model.decode(pieces)).strip()
        return clean_up_tokenization(text) if self.clean_up else text
