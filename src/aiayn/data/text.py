"""Plain text for language modelling: reading (through ``aiayn.data.text_files``), a character
vocabulary, the train/valid split and contiguous blocks.

A character vocabulary is the sorted set of characters of the training text (nanoGPT's
``shakespeare_char`` preparation), so ids are stable for a given text and the vocabulary is small
(78 symbols for the bundled Shakespeare).

Legend: B batch, T block length (context), N tokens in a split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from aiayn.data.text_files import data_error, read_lines


def _code_points(text: str) -> np.ndarray:
    """The code points of ``text`` as an int64 array (N,) (lone surrogates included)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)


EMPTY_TEXT = ("the file is empty or holds only whitespace; a language model needs text to learn "
              "from")


def text_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 text file with their ends, as ``read_text`` reads them (Windows line
    ends as LF), one at a time (``aiayn.data.token_files`` streams a corpus through them).

    Raises:
        as ``read_text``, except for an empty file.
    """
    for _, line in read_lines(path, what="text file", keep_ends=True):
        yield line[:-2] + "\n" if line.endswith("\r\n") else line


def read_text(path: str | Path) -> str:
    """The whole UTF-8 text of ``path`` (gzip-compressed if its name ends in ``.gz``), every
    character kept (line ends included) except a leading byte-order mark; Windows line ends
    (CR LF) read as LF, as Python's text mode reads them (no stray "\\r" in the vocabulary).

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        ValueError: the file is empty (or only whitespace), not UTF-8 (``path:line: ...``), or a
            ``.gz`` file that is not gzip.
    """
    text = "".join(text_lines(path))
    if not text.strip():
        raise data_error(path, EMPTY_TEXT)
    return text


def _line_of(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


class UnknownCharacter(ValueError):
    """A character outside a ``CharVocabulary``: ``char`` at ``index`` of the text encoded.
    ``located`` turns it into the error a user reads (``source:line: ...``, with the column)."""

    def __init__(self, char: str, index: int, size: int):
        super().__init__(f"character {char!r} is not in the model's vocabulary of {size} "
                         f"characters")
        self.char, self.index, self.size = char, index, size

    def located(self, source: str | Path, text: str, *, line: int = 1,
                column: int = 1) -> ValueError:
        """The error naming where the character is, ``text`` starting at (``line``, ``column``)
        of ``source``. Raise what it returns."""
        within, at = _line_of(text, self.index)
        at += column - 1 if within == 1 else 0
        return data_error(source, f"{self.args[0]} (column {at})", line=line + within - 1)


class CharVocabulary:
    """Characters <-> ids; id i is the i-th character in sorted order.

    Args:
        symbols: the characters, one per id (each a single character, no duplicates).
    """

    FILE = "vocabulary.json"

    def __init__(self, symbols: Sequence[str]):
        symbols = list(symbols)
        if not symbols:
            raise ValueError("a character vocabulary needs at least one character")
        for symbol in symbols:
            if not isinstance(symbol, str) or len(symbol) != 1:
                raise ValueError(f"vocabulary symbols must be single characters, got {symbol!r}")
        if len(set(symbols)) != len(symbols):
            raise ValueError("vocabulary symbols must be distinct")
        self.symbols = symbols
        # Code points in ascending order and the id of each: ``ids`` looks characters up by a
        # binary search over them, a whole text at once.
        codes = _code_points("".join(symbols))
        self._order = np.argsort(codes, kind="stable")
        self._codes = codes[self._order]

    @classmethod
    def from_text(cls, text: str) -> "CharVocabulary":
        return cls(sorted(set(text)))

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> "CharVocabulary":
        """The vocabulary of the text the lines spell, read one line at a time."""
        seen: set[str] = set()
        for line in lines:
            seen.update(line)
        return cls(sorted(seen))

    def __len__(self) -> int:
        return len(self.symbols)

    def ids(self, text: str) -> np.ndarray:
        """Ids of the characters of ``text``, an int64 array (N,).

        Raises:
            UnknownCharacter: the first character outside the vocabulary.
        """
        codes = _code_points(text)  # (N,)
        where = np.searchsorted(self._codes, codes).clip(max=len(self._codes) - 1)  # (N,)
        unknown = self._codes[where] != codes
        if unknown.any():
            index = int(unknown.argmax())
            raise UnknownCharacter(text[index], index, len(self))
        return self._order[where]

    def encode(self, text: str, *, source: str = "text") -> list[int]:
        """Ids of the characters of ``text``.

        Raises:
            ValueError: a character outside the vocabulary (``source:line: ...``, with the column).
        """
        try:
            return self.ids(text).tolist()
        except UnknownCharacter as error:
            raise error.located(source, text) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.symbols[i] for i in ids)

    def save(self, directory: str | Path) -> Path:
        """Write ``vocabulary.json`` into ``directory`` atomically; returns its path."""
        from aiayn.training.checkpoint import atomic_write_bytes  # a unique temporary name

        path = Path(directory) / self.FILE
        atomic_write_bytes(path, json.dumps({"kind": "char", "symbols": self.symbols},
                                            ensure_ascii=False).encode("utf-8"))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "CharVocabulary":
        path = Path(directory) / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("kind") != "char":
                raise ValueError(f"unknown vocabulary kind {data.get('kind')!r}")
            return cls(data["symbols"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError,
                ValueError) as error:
            raise ValueError(f"{path}: corrupt vocabulary ({error})") from None


# The last tenth of a text validates: nanoGPT's split of tiny Shakespeare, aiayn train lm's default.
VALID_FRACTION = 0.1


def split_text(text: str, valid_fraction: float = VALID_FRACTION) -> tuple[str, str]:
    """First ``1 - valid_fraction`` of the characters for training, the rest for validation
    (nanoGPT's split of tiny Shakespeare)."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction!r}")
    cut = int(len(text) * (1.0 - valid_fraction))
    return text[:cut], text[cut:]


def check_length(ids: Tensor | np.ndarray, block_size: int, what: str) -> None:
    """A split must hold at least one block of inputs plus its shifted targets."""
    if len(ids) < block_size + 1:
        raise ValueError(f"the {what} text has {len(ids)} tokens, shorter than the context of "
                         f"{block_size} + 1; give a longer text or a smaller context")


def token_slice(ids: Tensor | np.ndarray, start: int, stop: int) -> Tensor:
    """``ids[start:stop]`` as a long tensor: ``ids`` is a tensor or a (memory-mapped) numpy array
    of unsigned token ids (``aiayn.data.token_files``), read only where sliced."""
    if isinstance(ids, Tensor):
        return ids[start:stop]
    return torch.from_numpy(np.asarray(ids[start:stop], dtype=np.int64))


def random_blocks(ids: Tensor | np.ndarray, *, block_size: int, batch_size: int, batches: int,
                  generator: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    """``batches`` batches of windows at random offsets, nanoGPT's ``get_batch``; ``ids`` is a
    tensor or a memory-mapped array (only the windows are read).

    Yields inputs x (B, T) and targets y (B, T) = x shifted by one token.
    """
    check_length(ids, block_size, "training")
    last_start = len(ids) - block_size  # exclusive: room for the shifted target
    for _ in range(batches):
        starts = torch.randint(last_start, (batch_size,), generator=generator)  # (B,)
        windows = torch.stack([token_slice(ids, start, start + block_size + 1)
                               for start in starts.tolist()])  # (B, T + 1)
        yield windows[:, :-1], windows[:, 1:]


def contiguous_blocks(ids: Tensor | np.ndarray, *, block_size: int, batch_size: int
                      ) -> Iterator[tuple[Tensor, Tensor]]:
    """Every target of ``ids`` exactly once: non-overlapping blocks in order, the last one shorter.

    Yields x (B, T) and y (B, T); a final short block comes alone as (1, T') so nothing is padded.
    ``ids`` is a tensor or a memory-mapped array, read one batch at a time.
    """
    check_length(ids, block_size, "evaluation")
    targets = len(ids) - 1
    full = targets // block_size
    for first in range(0, full, batch_size):
        count = min(batch_size, full - first)
        span = token_slice(ids, first * block_size, (first + count) * block_size + 1)
        yield span[:-1].view(count, block_size), span[1:].view(count, block_size)
    rest = targets - full * block_size
    if rest:
        span = token_slice(ids, full * block_size, targets + 1)
        yield span[:-1].unsqueeze(0), span[1:].unsqueeze(0)
