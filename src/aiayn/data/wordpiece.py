"""The tokenizer of the encoder tasks (classification, masked LM): BERT's WordPiece, or a pretrained
encoder's own.

Wraps a Hugging Face ``tokenizers.Tokenizer`` (imported lazily): a WordPiece vocabulary trained on
the training texts, or read from a pretrained model's directory (``tokenizer.json`` or
``vocab.txt``) so that a fine-tuned checkpoint sees the ids it was pretrained with: BERT's
WordPiece, RoBERTa's byte-level BPE, XLM-RoBERTa's SentencePiece unigram. Sequences are
``[CLS] pieces [SEP]`` (BERT, Devlin et al. 2019, section 3; RoBERTa's ``<s> pieces </s>``), cut to
a maximum length; padding is the batcher's job.

The five special tokens are BERT's unless the checkpoint names others (``tokenizer_config.json`` /
``special_tokens_map.json``); ``save`` writes such names to ``special_tokens_map.json`` beside
``tokenizer.json``, and ``load`` reads them back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
# The roles of the special tokens (Hugging Face's names) and BERT's tokens for them
ROLES = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
BERT_SPECIAL_TOKENS = dict(zip(ROLES, SPECIAL_TOKENS))
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
SETTINGS_FILE = "tokenizer_config.json"
WORD_START = "\u2581"  # marks a word's first piece while the vocabulary is learned (SentencePiece's)


def wordpiece_vocabulary(bpe_vocabulary: dict[str, int]) -> dict[str, int]:
    """WordPiece token -> id from a BPE vocabulary learned on words marked with ``WORD_START``.

    Special tokens first, then the BPE pieces in BPE id order: "\u2581x" -> "x" (starts a word), "x" ->
    "##x" (continues one). Every single character gets both forms, as WordPiece's own alphabet does, so
    any word made of seen characters can be spelled (WordPiece turns a word it cannot spell into [UNK]).
    """
    vocabulary = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for piece, _ in sorted(bpe_vocabulary.items(), key=lambda item: item[1]):
        if piece in vocabulary:
            continue
        if piece.startswith(WORD_START):
            forms = [piece[len(WORD_START):]]
        elif len(piece) == 1:
            forms = [piece, "##" + piece]
        else:
            forms = ["##" + piece]
        for form in forms:
            if form:
                vocabulary.setdefault(form, len(vocabulary))
    return vocabulary


class WordPieceTokenizer:
    """Text -> ``[CLS] ... [SEP]`` id lists.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        special_tokens: role (``ROLES``) -> token text; None: BERT's (``BERT_SPECIAL_TOKENS``).
        clean_up: ``decode`` removes the spaces before punctuation (a checkpoint's
            ``clean_up_tokenization_spaces``, as ``transformers`` decodes).

    Attributes:
        pad_id / unk_id / cls_id / sep_id / mask_id: the special ids.
        vocab_size: number of ids.
    """

    def __init__(self, tokenizer: Any, *, source: str = "tokenizer",
                 special_tokens: dict[str, str] | None = None, clean_up: bool = False):
        self._tokenizer = tokenizer
        self.clean_up = clean_up
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.special_tokens = {**BERT_SPECIAL_TOKENS, **(special_tokens or {})}
        ids = {}
        for role in ROLES:
            token = self.special_tokens[role]
            index = tokenizer.token_to_id(token)
            if index is None:
                named = ", ".join(self.special_tokens[r] for r in ROLES)
                raise ValueError(f"{source}: the vocabulary has no {token} token (the {role}; an "
                                 f"encoder's tokenizer needs its {named})")
            ids[role] = index
        self.pad_id, self.unk_id = ids["pad_token"], ids["unk_token"]
        self.cls_id, self.sep_id, self.mask_id = (ids["cls_token"], ids["sep_token"],
                                                  ids["mask_token"])
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id)

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int = 8000, lowercase: bool = True,
              min_frequency: int = 2) -> "WordPieceTokenizer":
        """Learn a WordPiece vocabulary (BERT normalisation and pre-tokenisation) from ``texts``.

        The same texts give the same vocabulary in every process. ``vocab_size`` is the size of the
        BPE vocabulary it is made from; the result differs a little: every character seen gets
        both its word-start and its "##" continuing form (so a word of seen characters is never
        [UNK]), and BPE pieces can map onto the same WordPiece piece.

        Raises:
            ValueError: ``vocab_size`` too small for the special tokens.
        """
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

        if vocab_size < len(SPECIAL_TOKENS) + 1:
            raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 1}, got "
                             f"{vocab_size}")
        normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        # Hugging Face's WordPieceTrainer (BPE with a "##" prefix on continuing pieces) numbers its
        # "##" alphabet in hash-map order, which changes from process to process, and breaks merge
        # ties by those numbers: the same texts gave different vocabularies, so the same --seed gave
        # different models. Plain BPE over words whose start is marked is deterministic, and its
        # pieces map one to one onto WordPiece's: a marked piece starts a word, any other continues one.
        bpe = Tokenizer(models.BPE(unk_token=UNK))
        bpe.normalizer = normalizer
        bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.BertPreTokenizer(),
            pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always")])
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=list(SPECIAL_TOKENS), show_progress=False)
        bpe.train_from_iterator(texts, trainer=trainer)
        tokenizer = Tokenizer(models.WordPiece(wordpiece_vocabulary(bpe.get_vocab()), unk_token=UNK))
        tokenizer.normalizer = normalizer
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocabulary: same ids
        return cls(tokenizer, source="trained tokenizer")

    @classmethod
    def load(cls, path: str | Path) -> "WordPieceTokenizer":
        """Read ``tokenizer.json`` written by ``save`` (or by Hugging Face ``tokenizers``), with the
        special tokens of a ``special_tokens_map.json`` beside it (else BERT's) and the
        ``clean_up_tokenization_spaces`` of a ``tokenizer_config.json``.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a tokenizer file, or without its special tokens.
        """
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own Exception type
            raise ValueError(f"{path}: not a tokenizer file ({error})") from None
        return cls(tokenizer, source=str(path), **_directory_settings(path.parent, tokenizer))

    @classmethod
    def from_pretrained_dir(cls, directory: str | Path) -> "WordPieceTokenizer":
        """The tokenizer of a Hugging Face encoder directory: ``tokenizer.json`` with the special
        tokens the directory names (BERT's where it names none), else BERT's ``vocab.txt`` with
        ``tokenizer_config.json``'s settings, as ``transformers`` builds them
        (``aiayn.interop.hf_tokenizer.bert_vocab_tokenizer``).

        Raises:
            FileNotFoundError: neither file is there.
            ValueError: only a SentencePiece ``spm.model`` is there (DeBERTa's).
        """
        from aiayn.interop.hf_tokenizer import require_fast_tokenizer

        directory = Path(directory)
        require_fast_tokenizer(directory)  # DeBERTa's spm.model alone: say how to convert it
        if (directory / TOKENIZER_FILE).is_file():
            return cls.load(directory / TOKENIZER_FILE)
        vocab = directory / "vocab.txt"
        if not vocab.is_file():
            raise FileNotFoundError(f"{directory} has no {TOKENIZER_FILE} or vocab.txt")
        from aiayn.interop.hf_tokenizer import bert_vocab_tokenizer

        tokenizer = bert_vocab_tokenizer(directory)
        return cls(tokenizer, source=str(vocab), **_directory_settings(directory, tokenizer))

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as ``tokenizer.json`` (atomically), special tokens other than
        BERT's to ``special_tokens_map.json`` beside it, and ``clean_up`` to
        ``tokenizer_config.json``."""
        from aiayn.training.checkpoint import atomic_write_bytes

        path = Path(path)
        atomic_write_bytes(path, self._tokenizer.to_str().encode("utf-8"))
        if self.special_tokens != BERT_SPECIAL_TOKENS:
            atomic_write_bytes(path.parent / SPECIAL_TOKENS_FILE,
                               json.dumps(self.special_tokens, indent=1,
                                          ensure_ascii=False).encode("utf-8"))
        if self.clean_up:
            atomic_write_bytes(path.parent / SETTINGS_FILE,
                               b'{"clean_up_tokenization_spaces": true}\n')

    # --- use ------------------------------------------------------------------------------------
    def encode(self, texts: Sequence[str], *, max_length: int) -> list[list[int]]:
        """``[CLS] pieces [SEP]`` ids of each text, the pieces cut so the total is <= max_length.

        Raises:
            ValueError: ``max_length`` < 3 (no room for one piece).
        """
        if max_length < 3:
            raise ValueError(f"max_length must be at least 3 ([CLS] piece [SEP]), got {max_length}")
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        room = max_length - 2
        return [[self.cls_id, *encoding.ids[:room], self.sep_id] for encoding in encodings]

    def pieces(self, text: str) -> list[str]:
        """The word pieces of ``text`` (for inspection)."""
        return self._tokenizer.encode(text, add_special_tokens=False).tokens

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out (and spaces cleaned up with
        ``clean_up``)."""
        from aiayn.interop.hf_tokenizer import clean_up_tokenization

        text = self._tokenizer.decode(list(ids), skip_special_tokens=True)
        return clean_up_tokenization(text) if self.clean_up else text


def _directory_settings(directory: Path, tokenizer: Any) -> dict[str, Any]:
    """The special tokens a directory names and whether its ``tokenizer_config.json`` cleans up
    ``tokenizer``'s decoded text (``WordPieceTokenizer``'s keyword arguments)."""
    from aiayn.interop.hf_tokenizer import cleans_up, read_json_object, special_tokens

    named = special_tokens(directory)
    return {"special_tokens": {role: named[role] for role in ROLES if role in named},
            "clean_up": cleans_up(read_json_object(directory / SETTINGS_FILE), tokenizer)}
