"""Reading UTF-8 text files line by line with errors that name the file and the line.

Plain files and gzip files (``*.gz``, read transparently, so bundled data can stay compressed) are
both accepted. Each line is decoded on its own, so a bad byte is reported with its line number
instead of Python's "position 123456" in the whole file.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Iterator
from pathlib import Path


def check_readable_file(path: str | Path, *, what: str = "data file") -> Path:
    """``path`` as a Path, after checking that it exists and is a file.

    Raises:
        FileNotFoundError: nothing at ``path``.
        IsADirectoryError: ``path`` is a directory.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, expected a {what}")
    return path


def decode_lines(raw_lines: Iterable[bytes], source: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline) for each raw line.

    Raises:
        ValueError: a line that is not UTF-8 (names ``source``, the line and the byte).
    """
    for number, raw in enumerate(raw_lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad = raw[error.start:error.start + 1].hex()
            raise ValueError(f"{source}, line {number}: not UTF-8 text (byte 0x{bad} at column "
                             f"{error.start + 1}); convert the file to UTF-8") from None
        if number == 1 and line.startswith("\ufeff"):
            line = line[1:]  # a byte-order mark is not part of the first field
        yield number, line.rstrip("\r\n")


def read_lines(path: str | Path, *, what: str = "data file") -> Iterator[tuple[int, str]]:
    """(line number, text) for every line of a UTF-8 text file, optionally gzip-compressed.

    Raises:
        FileNotFoundError / IsADirectoryError: see ``check_readable_file``.
        ValueError: a line that is not UTF-8, or a corrupt gzip file.
    """
    path = check_readable_file(path, what=what)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            yield from decode_lines(handle, str(path))
    except (gzip.BadGzipFile, EOFError) as error:
        raise ValueError(f"{path}: corrupt gzip file ({error})") from None
