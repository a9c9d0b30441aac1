"""Parallel corpora: a TSV (``source<TAB>target``, optional header, optional split column) or two
line-aligned files, and a reproducible train/valid/test split.

Files are read through ``aiayn.data.text_files`` (plain or ``.gz`` UTF-8, errors as
``path:line: message``); this module only parses the columns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiayn.data.text_files import data_error, location, read_lines

SPLITS = ("train", "valid", "test")
# Header names recognised for the text columns, in order of preference.
SOURCE_NAMES = ("src", "en", "source_text")
TARGET_NAMES = ("tgt", "de", "target_text")


@dataclass(frozen=True)
class SentencePair:
    source: str
    target: str
    split: str | None = None  # from a split column, if the file has one
    origin: str = ""  # "file:line", for messages


def is_pair_header(names: Sequence[str]) -> bool:
    """Whether a first line's fields (stripped, lower-cased) name a parallel TSV's columns: a
    source, target or split column, and no field with a space (that is a sentence)."""
    return any(name in SOURCE_NAMES + TARGET_NAMES + ("split",) for name in names) \
        and not any(len(name.split()) > 1 for name in names)


def read_tsv(path: str | Path) -> list[SentencePair]:
    """Sentence pairs of a TSV file.

    Without a header the first two fields of each line are source and target (a third field, if
    any, is ignored). A header is recognised when its first line names the columns: the source
    column is ``src``/``en``, the target ``tgt``/``de`` (else the first two), and a ``split``
    column (train/valid/test) is kept. Column names hold no spaces: a first line with a space in a
    field is a pair, even when another field is ``de`` (a language column of a file without a
    header).

    Raises:
        FileNotFoundError / IsADirectoryError: no such file / a directory.
        ValueError: empty file, no pairs, a line with fewer fields than needed, an empty text,
            invalid UTF-8, a bad split value (``path:line: message``).
    """
    path = Path(path)
    pairs: list[SentencePair] = []
    source_col, target_col, split_col, width = 0, 1, None, 2
    saw_line = False
    for number, line in read_lines(path):
        if number == 1:
            saw_line = True
            names = [name.strip().lower() for name in line.split("\t")]
            if is_pair_header(names):
                source_col = next((names.index(n) for n in SOURCE_NAMES if n in names), 0)
                target_col = next((names.index(n) for n in TARGET_NAMES if n in names), 1)
                split_col = names.index("split") if "split" in names else None
                width = max(source_col, target_col, split_col or 0) + 1
                if len(names) < 2 or source_col == target_col:
                    raise data_error(path, f"header {line!r} needs a source and a target column",
                                     line=1)
                continue
        if not line.strip():
            continue  # blank lines (e.g. a trailing newline) carry no pair
        fields = line.split("\t")
        if len(fields) < width:
            raise data_error(path, f"expected at least {width} tab-separated fields, found "
                                   f"{len(fields)} in {_preview(line)}", line=number)
        source, target = fields[source_col].strip(), fields[target_col].strip()
        if not source or not target:
            side = "source" if not source else "target"
            raise data_error(path, f"empty {side} text in {_preview(line)}", line=number)
        split = None
        if split_col is not None:
            split = fields[split_col].strip()
            if split not in SPLITS:
                raise data_error(path, f"split must be one of {list(SPLITS)}, got {split!r}",
                                 line=number)
        pairs.append(SentencePair(source, target, split, location(path, number)))
    if not saw_line:
        raise data_error(path, "the file is empty")
    if not pairs:
        raise data_error(path, "no sentence pairs found")
    return pairs


def read_aligned(source_path: str | Path, target_path: str | Path) -> list[SentencePair]:
    """Sentence pairs from two line-aligned files (line i of one translates line i of the other).

    Raises:
        FileNotFoundError / IsADirectoryError: a file is missing / a directory.
        ValueError: empty files, different line counts, an empty line on one side only, invalid
            UTF-8 (``path:line: message``).
    """
    source_path, target_path = Path(source_path), Path(target_path)
    sources = list(read_lines(source_path))
    targets = list(read_lines(target_path))
    for path, lines in ((source_path, sources), (target_path, targets)):
        if not lines:
            raise data_error(path, "the file is empty")
    if len(sources) != len(targets):
        raise data_error(source_path, f"has {len(sources)} lines but {target_path} has "
                                      f"{len(targets)}; the files must be line-aligned")
    pairs = []
    for (number, source), (_, target) in zip(sources, targets):
        source, target = source.strip(), target.strip()
        if not source and not target:
            continue
        if not source or not target:
            path = source_path if not source else target_path
            raise data_error(path, "empty line opposite a non-empty one", line=number)
        pairs.append(SentencePair(source, target, None, location(source_path, number)))
    if not pairs:
        raise data_error(source_path, "no sentence pairs found")
    return pairs


def read_pairs(paths: Sequence[str | Path]) -> list[SentencePair]:
    """One TSV path, or a source and a target path."""
    if len(paths) == 1:
        return read_tsv(paths[0])
    if len(paths) == 2:
        return read_aligned(paths[0], paths[1])
    raise ValueError(f"expected a TSV file or a source and a target file, got {len(paths)} paths")


def split_of(pair: SentencePair, *, valid_fraction: float, test_fraction: float) -> str:
    """The split of a pair without a split column: a hash of its source text.

    Hashing (not shuffling) makes the split reproducible, independent of file order, and keeps
    repeated source sentences in one split, so nothing is evaluated on what was trained on.
    """
    digest = hashlib.sha256(pair.source.encode("utf-8")).digest()
    position = int.from_bytes(digest[:8], "big") / 2 ** 64
    if position < test_fraction:
        return "test"
    if position < test_fraction + valid_fraction:
        return "valid"
    return "train"


def split_pairs(pairs: Sequence[SentencePair], *, valid_fraction: float = 0.02,
                test_fraction: float = 0.02) -> dict[str, list[SentencePair]]:
    """{"train": [...], "valid": [...], "test": [...]}: the file's split column where present,
    else ``split_of``."""
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError("valid_fraction + test_fraction must leave training data")
    result: dict[str, list[SentencePair]] = {name: [] for name in SPLITS}
    for pair in pairs:
        split = pair.split or split_of(pair, valid_fraction=valid_fraction,
                                       test_fraction=test_fraction)
        result[split].append(pair)
    return result


def select_split(pairs: Sequence[SentencePair], split: str) -> list[SentencePair]:
    """The pairs of one split ("all": every pair)."""
    if split == "all":
        return list(pairs)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS) + ['all']}, got {split!r}")
    chosen = split_pairs(pairs)[split]
    if not chosen:
        raise ValueError(f"the data has no {split!r} pairs (use --split all for every pair)")
    return chosen


def _preview(line: str, width: int = 60) -> str:
    return repr(line if len(line) <= width else line[:width] + "...")
