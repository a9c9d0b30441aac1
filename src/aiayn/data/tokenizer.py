"""The joint source/target subword vocabulary (paper 5.1: a shared BPE vocabulary).

Byte-pair encoding learned with Hugging Face ``tokenizers`` on both sides of the training data, with
SentencePiece-style whitespace markers (Metaspace) so that decoding restores the text, after the
NFKC normalisation SentencePiece also applies by default (``nmt_nfkc``): "…" comes back as "...",
"²" as "2", a no-break space as a space, a decomposed "é" composed.
Ids 0..3 are <pad>, <s>, </s>, <unk>, matching ``TransformerConfig``'s pad/bos/eos defaults.
Saved as one ``tokenizer.json`` next to the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from aiayn.training.checkpoint import atomic_write_bytes

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
TOKENIZER_FILE = "tokenizer.json"


class SubwordTokenizer:
    """Text <-> subword ids; one vocabulary for both languages."""

    def __init__(self, backend):
        self._backend = backend  # a tokenizers.Tokenizer
        for token_id, token in enumerate(SPECIAL_TOKENS):
            if backend.token_to_id(token) != token_id:
                raise ValueError(f"tokenizer must map {token} to id {token_id}")

    @classmethod
    def train(cls, texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2
              ) -> "SubwordTokenizer":
        """Learn a BPE vocabulary of ``vocab_size`` entries (special tokens included).

        Raises:
            ValueError: vocab_size too small.
        """
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

        if vocab_size < len(SPECIAL_TOKENS) + 32:
            raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 32}, got "
                             f"{vocab_size}")
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.normalizer = normalizers.NFKC()
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=list(SPECIAL_TOKENS), show_progress=False)
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Subword ids of each text (no <s>/</s>; the batching adds those)."""
        return [encoding.ids for encoding in self._backend.encode_batch(list(texts),
                                                                       add_special_tokens=False)]

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Texts of id sequences; special tokens are dropped."""
        return self._backend.decode_batch([list(map(int, row)) for row in ids],
                                          skip_special_tokens=True)

    def save(self, path: str | Path) -> None:
        atomic_write_bytes(path, self._backend.to_str().encode("utf-8"))

    @classmethod
    def load(cls, path: str | Path) -> "SubwordTokenizer":
        """Raises FileNotFoundError / ValueError (corrupt file) naming ``path``."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer not found: {path}")
        try:
            backend = Tokenizer.from_str(path.read_text(encoding="utf-8"))
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"{path}: not a valid tokenizer file ({error})") from None
        return cls(backend)
