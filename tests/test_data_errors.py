"""Every data reader reports a problem in the same format: ``path:line: message`` for a line,
``path: message`` for the whole file (missing, a directory, empty, not gzip).

The readers all go through ``aiayn.data.text_files``; this test holds them to it, one row per
reader, so a reader that grows its own opening or decoding code shows up here.
"""

from __future__ import annotations

import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from aiayn.data.labelled_tsv import read_labelled_tsv
from aiayn.data.parallel import read_aligned, read_tsv
from aiayn.data.text import CharVocabulary, read_text
from aiayn.data.text_corpus import read_texts
from aiayn.data.text_files import decode_lines, read_lines


def read_aligned_target(path: Path) -> Any:
    """Two-file translation data with ``path`` as the target side (the source is fine)."""
    source = path.parent / "source.txt"
    source.write_text("a b\nc d\ne f\n", encoding="utf-8")
    return read_aligned(source, path)


def read_char_text(path: Path) -> Any:
    """Character LM text, encoded with a vocabulary that lacks 'z' (the line-level error)."""
    return CharVocabulary.from_text("abcdefg tx\n").encode(read_text(path), source=str(path))


@dataclass(frozen=True)
class Reader:
    name: str
    read: Callable[[Path], Any]
    suffix: str  # the file name's ending, before any .gz
    good: str  # a valid first line
    bad_line: str | None  # a second line this format rejects (None: no line-level rules)

    def __str__(self) -> str:
        return self.name


READERS = [
    Reader("read_lines", lambda p: list(read_lines(p)), ".txt", "any text", None),
    Reader("read_text", read_text, ".txt", "abc", None),
    Reader("char_text+vocabulary", read_char_text, ".txt", "abc", "a z"),
    Reader("read_tsv", read_tsv, ".tsv", "a b\tc d", "just one field"),
    Reader("read_aligned", read_aligned_target, ".txt", "x y", ""),
    Reader("read_labelled_tsv", read_labelled_tsv, ".tsv", "some text\tnet", "no label"),
    Reader("read_texts", read_texts, ".txt", "some text", None),
    Reader("read_texts_tsv", read_texts, ".tsv", "text\tlabel", "a\tb\tc"),
]
# Lines every reader accepts (a header for the TSV readers that want one), to cut short in gzip.
GZIPPED = gzip.compress(b"text\tlabel\n" + b"some words\tnet\n" * 200)
WITH_BAD_LINES = [reader for reader in READERS if reader.bad_line is not None]


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(gzip.compress(content) if path.name.endswith(".gz") else content)
    return path


def assert_line_error(error: BaseException, path: Path, line: int) -> str:
    """``error`` reads ``path:line: message``; returns the message."""
    match = re.fullmatch(re.escape(str(path)) + r":(\d+): (\S.*)", str(error), re.DOTALL)
    assert match, f"not 'path:line: message': {error}"
    assert int(match[1]) == line, str(error)
    return match[2]


def assert_file_error(error: BaseException, path: Path) -> str:
    """``error`` reads ``path: message`` (no line number); returns the message."""
    match = re.fullmatch(re.escape(str(path)) + r": (\S.*)", str(error), re.DOTALL)
    assert match and not re.match(r"\d+:", match[1]), f"not 'path: message': {error}"
    return match[1]


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("reader", READERS, ids=str)
def test_bad_byte_is_path_line_message(tmp_path, reader, gz):
    path = write(tmp_path / f"bad{reader.suffix}{'.gz' if gz else ''}",
                 f"{reader.good}\n".encode() + "caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError) as info:
        reader.read(path)
    message = assert_line_error(info.value, path, 2)
    assert message == "not UTF-8 text (byte 0xe9 at column 4); convert the file to UTF-8"


@pytest.mark.parametrize("reader", WITH_BAD_LINES, ids=str)
def test_bad_line_is_path_line_message(tmp_path, reader):
    path = write(tmp_path / f"bad{reader.suffix}",
                 f"{reader.good}\n{reader.bad_line}\n{reader.good}\n".encode())
    with pytest.raises(ValueError) as info:
        reader.read(path)
    assert_line_error(info.value, path, 2)


@pytest.mark.parametrize("reader", READERS, ids=str)
def test_missing_file_and_directory_are_path_message(tmp_path, reader):
    missing = tmp_path / f"missing{reader.suffix}"
    with pytest.raises(FileNotFoundError) as info:
        reader.read(missing)
    assert assert_file_error(info.value, missing).endswith("not found")
    directory = tmp_path / f"folder{reader.suffix}"
    directory.mkdir()
    with pytest.raises(IsADirectoryError) as info:
        reader.read(directory)
    assert assert_file_error(info.value, directory).startswith("is a directory")


@pytest.mark.parametrize("reader", [r for r in READERS if r.name != "read_lines"], ids=str)
def test_empty_file_is_path_message(tmp_path, reader):
    path = write(tmp_path / f"empty{reader.suffix}", b"")
    with pytest.raises(ValueError) as info:
        reader.read(path)
    assert assert_file_error(info.value, path).startswith("the file is empty")


@pytest.mark.parametrize("content, cause", [
    (b"plain text\n", "Not a gzipped file"),
    (GZIPPED[:len(GZIPPED) // 2], "end-of-stream marker"),
], ids=["not-gzip", "truncated"])
@pytest.mark.parametrize("reader", READERS, ids=str)
def test_bad_gzip_is_path_message(tmp_path, reader, content, cause):
    path = tmp_path / f"data{reader.suffix}.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        reader.read(path)
    message = assert_file_error(info.value, path)
    assert message.startswith("not a valid gzip file") and cause in message


def test_stdin_lines_use_the_same_format():
    lines = decode_lines([b"\xef\xbb\xbffirst\r\n", b"second\n", b"th\xffird\n"], "stdin")
    assert next(lines) == (1, "first") and next(lines) == (2, "second")  # BOM and CRLF dropped
    with pytest.raises(ValueError) as info:
        next(lines)
    assert str(info.value) == ("stdin:3: not UTF-8 text (byte 0xff at column 3); convert the file "
                               "to UTF-8")


def test_keep_ends_gives_back_the_whole_text(tmp_path):
    text = "\ufeffone\r\ntwo\n\nthree"
    path = write(tmp_path / "t.txt.gz", text.encode())
    assert "".join(line for _, line in read_lines(path, keep_ends=True)) == text[1:]
    assert [line for _, line in read_lines(path)] == ["one", "two", "", "three"]
