"""Marian's tokenizer: SentencePiece models ``source.spm`` / ``target.spm`` plus the ids of
``vocab.json``, as ``transformers.MarianTokenizer`` uses them (``aiayn.interop.hf_sentencepiece``).

Encoding splits a text into pieces with the source model (a leading ``>>xx<<`` language code is kept
as one token, and so is a special token's text inside it, e.g. ``</s>``), looks each piece up in
``vocab.json`` (a piece it lacks is ``<unk>``) and appends ``</s>``. Decoding drops the special
tokens and joins the pieces with the source model when the two sides share ``vocab.json``
(MarianTokenizer's default, ``separate_vocabs=false``), else with the target model. Targets for
training are encoded with the target model. MarianTokenizer also normalises punctuation with
``sacremoses`` when that package is installed; aiayn does not.
"""

from __future__ import annotations

import re
from pathlib import Path

from aiayn.interop.hf_sentencepiece import WORD_START, load_model, piece_ids, read_json

SOURCE_SPM, TARGET_SPM, VOCAB = "source.spm", "target.spm", "vocab.json"


class MarianTokenizer:
    """Text <-> ids with a Marian checkpoint's SentencePiece models and vocabulary.

    Same interface as ``aiayn.interop.hf_tokenizer.PretrainedTokenizer``.

    Raises:
        FileNotFoundError: a file is missing. ValueError: a file is unreadable, or ``vocab.json``
            lacks ``<unk>`` / ``</s>`` / ``<pad>``.
    """

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        for name in (SOURCE_SPM, TARGET_SPM, VOCAB):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory / name}: missing (a Marian tokenizer needs "
                                        f"{SOURCE_SPM}, {TARGET_SPM} and {VOCAB})")
        settings = read_json(directory / "tokenizer_config.json") \
            if (directory / "tokenizer_config.json").is_file() else {}
        self.vocabulary: dict[str, int] = read_json(directory / VOCAB)
        self.separate = bool(settings.get("separate_vocabs", False))
        target_file = directory / str(settings.get("target_vocab_file") or "target_vocab.json")
        self.target_vocabulary = read_json(target_file) if self.separate else self.vocabulary
        names = {"unk_token": settings.get("unk_token", "<unk>"),
                 "eos_token": settings.get("eos_token", "</s>"),
                 "pad_token": settings.get("pad_token", "<pad>")}
        missing = [token for token in names.values() if token not in self.vocabulary]
        if missing:
            raise ValueError(f"{directory / VOCAB}: no entry for {', '.join(missing)}")
        self.special_ids = {name: self.vocabulary[token] for name, token in names.items()}
        # a special token's text is that token, never pieces (the longest first: '</s>' < '</s>x')
        self._special = set(names.values())
        self._split = re.compile("(" + "|".join(
            re.escape(token) for token in sorted(self._special, key=len, reverse=True)) + ")")
        self.models = [load_model(directory / name, "Marian") for name in (SOURCE_SPM, TARGET_SPM)]
        self._tokens = {index: token for token, index in self.target_vocabulary.items()}
        self.files = [SOURCE_SPM, TARGET_SPM, VOCAB] + (
            [target_file.name] if self.separate else [])

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    @property
    def pad_id(self) -> int:
        return self.special_ids["pad_token"]

    def token_to_id(self, token: str) -> int | None:
        return self.vocabulary.get(token)

    def id_to_token(self, index: int) -> str:
        return self._tokens.get(int(index), f"<{index}>")

    def tokens(self, text: str, *, add_special_tokens: bool = True, target: bool = False
               ) -> list[str]:
        """Pieces of ``text`` (``</s>`` appended by default); ``target``: the target model's."""
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # a language code
            code, text = [text[:end + 2]], text[end + 2:]
        model = self.models[1 if target else 0]
        pieces = code + [piece for part in self._split.split(text) if part  # odd parts: specials
                         for piece in ([part] if part in self._special
                                       else model.encode(part, out_type=str))]
        return pieces + ([self.id_to_token(self.special_ids["eos_token"])]
                         if add_special_tokens else [])

    def encode(self, text: str, *, add_special_tokens: bool = True, target: bool = False
               ) -> list[int]:
        vocabulary = self.target_vocabulary if target else self.vocabulary
        unk = vocabulary.get("<unk>", self.special_ids["unk_token"])
        pieces = self.tokens(text, add_special_tokens=False, target=target)
        ids = piece_ids(pieces, vocabulary, unk)
        return ids + ([self.special_ids["eos_token"]] if add_special_tokens else [])

    def encode_batch(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        special = set(self.special_ids.values())
        pieces = [self.id_to_token(i) for i in ids if not (skip_special_tokens and i in special)]
        model = self.models[1 if self.separate else 0]
        return model.decode_pieces(pieces).replace(WORD_START, " ").strip()
