"""What the slow SentencePiece tokenizers of ``transformers`` share (Marian's ``MarianTokenizer``,
M2M100's ``M2M100Tokenizer``): a SentencePiece model splits the text into pieces, and a
``vocab.json`` of the checkpoint, not the model's own numbering, gives each piece its id (a piece
the vocabulary lacks is ``<unk>``). ``sentencepiece`` is imported only when a model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORD_START = "\u2581"  # SentencePiece's word-start mark


def read_json(path: Path) -> Any:
    """A tokenizer file's JSON; ValueError naming the file when it is unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from None


def load_model(path: Path, family: str):
    """A ``sentencepiece.SentencePieceProcessor`` loaded from ``path``.

    Raises:
        ValueError: sentencepiece is not installed (naming ``family``'s tokenizer), or ``path`` is
            not a SentencePiece model.
    """
    try:
        import sentencepiece
    except ImportError:
        raise ValueError(f"a {family} tokenizer ({Path(path).name}) needs the sentencepiece "
                         f"package: pip install sentencepiece") from None
    model = sentencepiece.SentencePieceProcessor()
    try:
        model.Load(str(path))
    except (OSError, RuntimeError) as error:
        raise ValueError(f"{path}: not a SentencePiece model ({error})") from None
    return model


def piece_ids(pieces: list[str], vocabulary: dict[str, int], unk_id: int) -> list[int]:
    """The ``vocab.json`` ids of SentencePiece pieces, ``unk_id`` for those it lacks."""
    return [vocabulary.get(piece, unk_id) for piece in pieces]
