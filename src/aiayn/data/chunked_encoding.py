"""Encoding a text in chunks that give the ids of encoding it whole.

A corpus of hundreds of megabytes is encoded in pieces (``aiayn.data.token_files`` streams it to
disk), and the pieces must not change the ids. The text is cut into chunks of about 64 K characters
that end after a line ending in a non-space character and before a line starting with one (GPT-2's
pre-tokenizer never joins text across such a point). Each chunk after the first is encoded after
the last line of the one before (at most 1 K characters, ``chunk_context``) in the same call as
that line alone, whose ids are dropped from the front: a tokenizer that marks the start of a text
(SentencePiece's ``Metaspace``, Llama 2's) then marks only the text's start, and the ids are those
of encoding the whole text at once. Where the line's ids are not a prefix of the line + chunk's (a
token joins the two), that chunk is encoded alone, with a warning.

- ``encode_chunks``: chunks encoded as above, the ids appended to a binary file;
- ``encode_text``: a range of a text file's characters encoded the same way, in memory
  (evaluation).

A character outside a character vocabulary is reported at its line and column of the file, however
the chunks fall. Ids are ``uint16`` when the vocabulary has at most 65,536 entries, else ``uint32``.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from aiayn.data.text import UnknownCharacter, text_lines

# Chunks of about 64 K characters, 16 to an encode_batch call (which the tokenizers library runs in
# parallel): on 93 MB of text, larger calls held more memory (8 chunks of 1 M characters: a peak
# of 1.1 GB, against 0.3 GB) and were no faster.
CHUNK_CHARACTERS = 1 << 16
CHUNKS_PER_BATCH = 16
# Each chunk after the first is encoded after the last line of the one before, at most this much
# of it (see the module docstring)
CONTEXT_CHARACTERS = 1 << 10


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def text_chunks(lines: Iterator[str]) -> Iterator[str]:
    """The concatenated lines in pieces of about ``CHUNK_CHARACTERS``, cut only after a line that
    ends in a non-space character and before one that starts with one (see the module docstring)."""
    buffer: list[str] = []
    size = 0
    for line in lines:
        if (size >= CHUNK_CHARACTERS and line[:1] and not line[0].isspace()
                and buffer[-1].endswith("\n") and len(buffer[-1]) > 1
                and not buffer[-1][-2].isspace()):
            yield "".join(buffer)
            buffer, size = [], 0
        buffer.append(line)
        size += len(line)
    if buffer:
        yield "".join(buffer)




# What encodes a batch of texts into their ids (lists or arrays), without special tokens.
EncodeBatch = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclass
class Position:
    """Where the next character of a text read in order stands: line and column (1-based)."""

    line: int = 1
    column: int = 1

    def advance(self, text: str) -> None:
        newlines = text.count("\n")
        self.line += newlines
        self.column = len(text) - text.rfind("\n") if newlines else self.column + len(text)


def chunk_context(chunk: str) -> str:
    """What the next chunk is encoded after: this chunk's last line, at most ``CONTEXT_CHARACTERS``
    of its end."""
    start = chunk.rfind("\n", 0, len(chunk) - 1) + 1
    return chunk[max(start, len(chunk) - CONTEXT_CHARACTERS):]


def encode_chunks(chunks: Iterator[str], encode_batch: EncodeBatch, out: BinaryIO,
                  dtype: np.dtype, vocab_size: int, where: str,
                  position: Position | None = None) -> tuple[int, int]:
    """Encode ``chunks`` (each after ``chunk_context`` of the one before, as the module docstring
    says) and append the ids to ``out``; (tokens, characters) written. ``position``: where the first
    chunk starts in ``where`` (advanced past the chunks), so that a character outside a
    ``CharVocabulary`` is reported at its line and column.

    Raises:
        ValueError: an id outside the vocabulary.
    """
    tokens = characters = joined = started = 0
    position = position or Position()
    pending: list[tuple[str, str]] = []  # (context, chunk)
    context = ""  # the start of a split has none: it is the start of the text encoded whole

    def flush() -> None:
        nonlocal tokens, joined, started
        texts = [before + chunk for before, chunk in pending]
        texts += [before for before, _ in pending if before]  # the contexts alone, after
        try:
            encoded = encode_batch(texts)
        except UnknownCharacter:  # which chunk, and where it starts (the error path only)
            for _, chunk in pending:
                try:
                    encode_batch([chunk])
                except UnknownCharacter as error:
                    raise error.located(where, chunk, line=position.line,
                                        column=position.column) from None
                position.advance(chunk)
            raise
        alone = iter(encoded[len(pending):])
        for (before, chunk), ids in zip(pending, encoded):
            array = np.asarray(ids, dtype=np.int64)
            if before:
                started += 1
                head = np.asarray(next(alone), dtype=np.int64)
                if np.array_equal(array[:head.size], head):
                    array = array[head.size:]
                else:  # a token joins the two lines: no cut gives the whole text's ids here
                    joined += 1
                    array = np.asarray(encode_batch([chunk])[0], dtype=np.int64)
            if array.size and (array.min() < 0 or array.max() >= vocab_size):
                raise ValueError(f"{where}: the tokenizer produced id {int(array.max())}, outside "
                                 f"its vocabulary of {vocab_size}")
            out.write(array.astype(dtype.newbyteorder("<")).tobytes())
            tokens += array.size
            position.advance(chunk)
        pending.clear()

    for chunk in chunks:
        characters += len(chunk)
        pending.append((context, chunk))
        context = chunk_context(chunk)
        if len(pending) == CHUNKS_PER_BATCH:
            flush()
    if pending:
        flush()
    if joined:
        warnings.warn(f"{where}: the tokenizer joins the end of a line and the start of the next "
                      f"into one token at {joined} of {started} chunk starts; those chunks were "
                      f"encoded on their own, so their first ids can differ from those of "
                      f"encoding the text whole", stacklevel=2)
    return tokens, characters


def encode_text(path: str | Path, *, encode_batch: EncodeBatch, vocab_size: int, start: int = 0,
                stop: int | None = None) -> tuple[np.ndarray, int]:
    """The ids of characters ``[start, stop)`` of the text file ``path`` (None: to its end),
    encoded in memory as ``TokenFiles.write`` encodes a split (the same chunks, so the same ids);
    and the number of characters encoded.

    Raises:
        FileNotFoundError / IsADirectoryError / ValueError: as ``aiayn.data.text.text_lines``; an
            id outside the vocabulary (or a character outside a character vocabulary, at its line
            and column).
    """
    position, seen = Position(), 0

    def part() -> Iterator[str]:
        nonlocal seen
        for line in text_lines(path):
            end = seen + len(line)
            if end <= start:  # a whole line before the part (so it ends in a newline)
                position.line += 1
            else:
                if seen < start:  # the part starts inside this line
                    position.column += start - seen
                piece = line[max(0, start - seen):len(line) if stop is None else stop - seen]
                if piece:
                    yield piece
            seen = end
            if stop is not None and seen >= stop:
                return

    dtype = token_dtype(vocab_size)
    buffer = io.BytesIO()
    # part() moves position to where the part starts before it yields; positions are read only
    # once a chunk is encoded
    _, characters = encode_chunks(text_chunks(part()), encode_batch, buffer, dtype, vocab_size,
                                 str(path), position)
    return np.frombuffer(buffer.getbuffer(), dtype=dtype.newbyteorder("<")), characters
