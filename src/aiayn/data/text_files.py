"""The one reader of text data: opens a file, decodes it line by line, reports errors in one format.

Every data reader (translation pairs, labelled TSV, masked-LM texts, character LM text) reads
through here, so every data error reads the same way:

* ``path:line: message`` for a problem on a line (a byte that is not UTF-8, a bad field), and
* ``path: message`` for a problem with the whole file (not found, a directory, empty, not gzip).

Plain files and gzip files (``*.gz``, decompressed on the fly, so bundled data can stay compressed)
are both accepted. Each line is decoded on its own, so a bad byte is reported with its line number
instead of Python's "position 123456" in the whole file.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path


def location(path: str | Path, line: int | None = None) -> str:
    """``path:line``, or ``path`` alone: how every data error begins."""
    return f"{path}:{line}" if line is not None else str(path)


def data_error(path: str | Path, message: str, *, line: int | None = None,
               kind: type[Exception] = ValueError) -> Exception:
    """An exception (``ValueError`` unless ``kind`` says otherwise) reading ``path:line: message``
    (``path: message`` without a line). Raise what it returns."""
    return kind(f"{location(path, line)}: {message}")


def check_readable_file(path: str | Path, *, what: str = "data file") -> Path:
    """``path`` as a Path, after checking that it exists and is a file.

    Raises:
        FileNotFoundError: nothing at ``path`` (``path: <what> not found``).
        IsADirectoryError: ``path`` is a directory.
    """
    path = Path(path)
    if not path.exists():
        raise data_error(path, f"{what} not found", kind=FileNotFoundError)
    if path.is_dir():
        raise data_error(path, f"is a directory, expected a {what}", kind=IsADirectoryError)
    return path


def decode_lines(raw_lines: Iterable[bytes], source: str, *, keep_ends: bool = False
                 ) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) for each raw line; a leading byte-order mark is dropped.

    Args:
        raw_lines: byte lines, e.g. a file opened in binary mode or ``sys.stdin.buffer``.
        source: the name errors give (a path, or "stdin").
        keep_ends: keep each line's newline (``"".join`` of the lines is then the whole text);
            by default it is stripped, with a ``\\r`` before it.

    Raises:
        ValueError: a line that is not UTF-8 (``source:line: not UTF-8 text (byte ... at column
            ...)``).
    """
    for number, raw in enumerate(raw_lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad = raw[error.start:error.start + 1].hex()
            raise data_error(source, f"not UTF-8 text (byte 0x{bad} at column {error.start + 1}); "
                                     f"convert the file to UTF-8", line=number) from None
        if number == 1 and line.startswith("\ufeff"):
            line = line[1:]  # a byte-order mark is not part of the text
        yield number, line if keep_ends else line.rstrip("\r\n")


def read_lines(path: str | Path, *, what: str = "data file", keep_ends: bool = False
               ) -> Iterator[tuple[int, str]]:
    """(line number, text) for every line of a UTF-8 text file, gzip-compressed if it ends in .gz.

    Args:
        path: the file.
        what: what the file is, for the not-found and directory messages ("text file", ...).
        keep_ends: see ``decode_lines``.

    Raises:
        FileNotFoundError / IsADirectoryError: see ``check_readable_file``.
        ValueError: a line that is not UTF-8, or a ``.gz`` file that is not (or no longer) gzip.
    """
    path = check_readable_file(path, what=what)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            yield from decode_lines(handle, str(path), keep_ends=keep_ends)
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:  # not gzip, truncated, corrupt
        raise data_error(path, f"not a valid gzip file ({error})") from None
