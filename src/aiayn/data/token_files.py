"""Token files: a text encoded once into flat arrays of token ids, memory-mapped for training.

A language model reads its corpus as token ids. Holding them as a Python list costs ~36 bytes a
token (a tensor of int64, 8), so a corpus of some hundred million tokens would not fit in memory;
nanoGPT instead writes the ids once to ``train.bin`` / ``val.bin`` (raw little-endian ``uint16``)
and memory-maps them. aiayn does the same, for characters and subwords, and reads nanoGPT's files
as they are.

- ``TokenFiles.write`` streams a UTF-8 text file (``aiayn.data.text_files``; ``.gz`` allowed)
  through an encoder (``EncodeBatch``): the first ``1 - valid_fraction`` of the characters train,
  the rest validate (the character split of ``aiayn.data.text.split_text``). Each split is encoded
  in chunks that give the ids of encoding it whole (``aiayn.data.chunked_encoding``). No special
  tokens are added. It writes ``train.bin``, ``val.bin`` and ``tokens.json`` (the counts, the
  dtype, and what they were made from, so a resumed run reuses them only when the text and the
  tokenizer are the same), under temporary names renamed when complete; ``TokenFiles.open`` maps
  them again.
- ``TokenFiles.open_nanogpt``: nanoGPT's prepared directory (``train.bin`` + ``val.bin``, uint16).

Ids are ``uint16`` when the vocabulary has at most 65,536 entries, else ``uint32``
(``token_dtype``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from aiayn.data.chunked_encoding import (EncodeBatch, Position, encode_chunks, text_chunks,
                                         token_dtype)
from aiayn.data.text import EMPTY_TEXT, text_lines
from aiayn.data.text_files import data_error

TRAIN_FILE, VALID_FILE, INFO_FILE = "train.bin", "val.bin", "tokens.json"
FORMAT = 1


def count_characters(path: str | Path) -> int:
    """Characters of the text of ``path`` (read as ``aiayn.data.text.text_lines`` reads it).

    Raises:
        ValueError: the file is empty or holds only whitespace (and as ``read_lines``).
    """
    count, blank = 0, True
    for line in text_lines(path):
        count += len(line)
        blank = blank and not line.strip()
    if blank:
        raise data_error(path, EMPTY_TEXT)
    return count


def split_lines(path: str | Path, cut: int) -> tuple[Iterator[str], Callable[[], Iterator[str]]]:
    """The lines of the text's first ``cut`` characters (the last one cut short where ``cut`` falls
    inside it), and a function giving the lines of the rest once those are consumed."""
    lines = text_lines(path)
    rest: list[str] = []

    def head() -> Iterator[str]:
        seen = 0
        for line in lines:
            if seen + len(line) <= cut:
                seen += len(line)
                yield line
                continue
            if cut > seen:
                yield line[:cut - seen]
            rest.append(line[cut - seen:])
            return

    def tail() -> Iterator[str]:
        yield from (line for line in rest if line)
        yield from lines

    return head(), tail



def tokenizer_fingerprint(serialised: str) -> str:
    return hashlib.sha256(serialised.encode("utf-8")).hexdigest()


def data_fingerprint(path: str | Path) -> dict[str, Any]:
    """What identifies a data file cheaply: its resolved path, size and modification time."""
    stat = Path(path).stat()
    return {"data": str(Path(path).resolve()), "data_bytes": stat.st_size,
            "data_mtime_ns": stat.st_mtime_ns}


@dataclass
class TokenFiles:
    """The token ids of a text's two splits, memory-mapped (or in memory).

    Attributes:
        train / valid: 1-D arrays of ids (``numpy.memmap`` when read from files).
        train_characters / valid_characters: the characters each split was encoded from (None for
            nanoGPT's files, which do not say).
        info: the contents of ``tokens.json`` (what they were made from).
    """

    train: np.ndarray
    valid: np.ndarray
    train_characters: int | None
    valid_characters: int | None
    info: dict[str, Any]

    @classmethod
    def write(cls, path: str | Path, *, encode_batch: EncodeBatch,
              vocab_size: int, tokenizer_id: str, valid_fraction: float,
              directory: str | Path | None) -> "TokenFiles":
        """Encode the text file ``path`` (see the module docstring) into ``directory`` (None: into
        memory) and return the two splits.

        Args:
            encode_batch: texts -> their ids, without special tokens.
            vocab_size: ids must be below it; picks the dtype.
            tokenizer_id: identifies the tokenizer (``tokenizer_fingerprint``), kept in tokens.json.

        Raises:
            FileNotFoundError / IsADirectoryError / ValueError: as ``count_characters``; a split
                without a character; an id outside the vocabulary.
        """
        if not 0.0 < valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction!r}")
        characters = count_characters(path)
        cut = int(characters * (1.0 - valid_fraction))
        if cut == 0 or cut == characters:
            raise data_error(path, f"{characters} characters are too few to split "
                                   f"{1 - valid_fraction:g} / {valid_fraction:g}")
        dtype = token_dtype(vocab_size)
        info = {"format": FORMAT, **data_fingerprint(path), "valid_fraction": valid_fraction,
                "tokenizer": tokenizer_id, "vocab_size": vocab_size, "dtype": dtype.name}
        head, tail = split_lines(path, cut)
        splits = ((TRAIN_FILE, lambda: head), (VALID_FILE, tail))  # tail: only once head is read
        counts, position = {}, Position()  # the validation split goes on where training ends

        def encode(name: str, lines: Callable[[], Iterator[str]], out: BinaryIO) -> None:
            counts[name] = encode_chunks(text_chunks(lines()), encode_batch, out, dtype,
                                         vocab_size, str(path), position)

        if directory is None:
            import io

            buffers = {name: io.BytesIO() for name, _ in splits}
            for name, lines in splits:
                encode(name, lines, buffers[name])
            arrays = {name: np.frombuffer(buffer.getbuffer(), dtype=dtype.newbyteorder("<"))
                      for name, buffer in buffers.items()}
            info.update(cls._counts(counts))
            return cls(arrays[TRAIN_FILE], arrays[VALID_FILE], counts[TRAIN_FILE][1],
                       counts[VALID_FILE][1], info)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / INFO_FILE).unlink(missing_ok=True)  # the files below are about to change
        for name, lines in splits:
            temporary = directory / f".{name}.{os.getpid()}.tmp"
            try:
                with open(temporary, "wb") as out:
                    encode(name, lines, out)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, directory / name)
            finally:
                temporary.unlink(missing_ok=True)
        info.update(cls._counts(counts))
        from aiayn.training.checkpoint import atomic_write_bytes

        atomic_write_bytes(directory / INFO_FILE, json.dumps(info, indent=1).encode("utf-8"))
        return cls.open(directory)

    @staticmethod
    def _counts(counts: dict[str, tuple[int, int]]) -> dict[str, int]:
        return {"train_tokens": counts[TRAIN_FILE][0], "valid_tokens": counts[VALID_FILE][0],
                "train_characters": counts[TRAIN_FILE][1],
                "valid_characters": counts[VALID_FILE][1]}

    @classmethod
    def open(cls, directory: str | Path) -> "TokenFiles":
        """The files ``write`` made in ``directory``.

        Raises:
            FileNotFoundError: no tokens.json. ValueError: a file of the wrong size or a corrupt
                tokens.json.
        """
        directory = Path(directory)
        try:
            info = json.loads((directory / INFO_FILE).read_text(encoding="utf-8"))
            dtype = np.dtype(info["dtype"]).newbyteorder("<")
            arrays = [cls._map(directory / name, dtype, info[key])
                      for name, key in ((TRAIN_FILE, "train_tokens"), (VALID_FILE, "valid_tokens"))]
            return cls(*arrays, info["train_characters"], info["valid_characters"], info)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{directory / INFO_FILE}: corrupt ({error!r})") from None

    @staticmethod
    def _map(path: Path, dtype: np.dtype, count: int | None) -> np.ndarray:
        if not path.is_file():
            raise FileNotFoundError(f"token file not found: {path}")
        size = path.stat().st_size
        if size % dtype.itemsize or (count is not None and size != count * dtype.itemsize):
            expected = f"{count} ids" if count is not None else f"a multiple of {dtype.itemsize}"
            raise ValueError(f"{path}: {size} bytes, not {expected} of {dtype.name}; the file is "
                             f"truncated or of another kind")
        if size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r")

    def matches(self, info: dict[str, Any]) -> bool:
        """Whether these files were made from what ``info`` describes (the keys ``write`` sets
        before encoding)."""
        return all(self.info.get(key) == value for key, value in info.items())

    @classmethod
    def open_nanogpt(cls, directory: str | Path, *, vocab_size: int) -> "TokenFiles":
        """nanoGPT's prepared data: ``train.bin`` and ``val.bin`` of uint16 ids in ``directory``.

        Raises:
            FileNotFoundError: a file is missing. ValueError: a file of odd size, empty, or holding
                an id outside the vocabulary of ``vocab_size`` (the whole file is checked).
        """
        directory = Path(directory)
        dtype = np.dtype(np.uint16).newbyteorder("<")
        arrays = []
        for name in (TRAIN_FILE, VALID_FILE):
            array = cls._map(directory / name, dtype, None)
            if array.size == 0:
                raise ValueError(f"{directory / name}: no tokens")
            largest = max(int(array[start:start + (1 << 26)].max())
                          for start in range(0, array.size, 1 << 26))
            if largest >= vocab_size:
                raise ValueError(f"{directory / name} holds token id {largest}, outside the "
                                 f"tokenizer's vocabulary of {vocab_size}: the files were made "
                                 f"with another tokenizer")
            arrays.append(array)
        info = {"format": FORMAT, "nanogpt": str(directory.resolve()), "dtype": dtype.name,
                "train_tokens": int(arrays[0].size), "valid_tokens": int(arrays[1].size)}
        return cls(arrays[0], arrays[1], None, None, info)
