"""Labelled text in TSV: ``text<TAB>label`` rows, an optional header, an optional split column.

Format (UTF-8, optionally gzip-compressed, no quoting, no tabs inside fields):

* without a header, every row is exactly ``text<TAB>label``;
* with a header (a first row naming a ``text`` and a ``label`` column, in any order), every row has
  as many fields as the header, extra columns (e.g. ``package``) are ignored, and a ``split`` column,
  when present, assigns each row to ``train``, ``valid`` or ``test``.

Blank lines are skipped. The file is read through ``aiayn.data.text_files`` (errors as
``path:line: message``); this module only parses the columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiayn.data.text_files import data_error, read_lines

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class LabelledTexts:
    """Rows of a labelled TSV file, in file order.

    Attributes:
        texts / labels: one per row.
        lines: the 1-based line number of each row (for error messages).
        splits: each row's split when the file has a ``split`` column, else None.
        source: the file the rows came from.
    """

    texts: tuple[str, ...]
    labels: tuple[str, ...]
    lines: tuple[int, ...]
    splits: tuple[str, ...] | None
    source: str

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, indices: list[int]) -> "LabelledTexts":
        """The rows at ``indices`` (in that order)."""
        return LabelledTexts(
            texts=tuple(self.texts[i] for i in indices), labels=tuple(self.labels[i] for i in indices),
            lines=tuple(self.lines[i] for i in indices),
            splits=None if self.splits is None else tuple(self.splits[i] for i in indices),
            source=self.source)

    def split(self, name: str) -> "LabelledTexts":
        """The rows whose split column says ``name``.

        Raises:
            ValueError: the file has no split column.
        """
        if self.splits is None:
            raise ValueError(f"{self.source} has no split column")
        return self.subset([i for i, split in enumerate(self.splits) if split == name])


def _header_columns(fields: list[str]) -> dict[str, int] | None:
    names = [field.strip().lower() for field in fields]
    if "text" in names and "label" in names:
        return {name: index for index, name in enumerate(names)}
    return None


def read_labelled_tsv(path: str | Path) -> LabelledTexts:
    """Read a labelled TSV file (see the module docstring for the format).

    Args:
        path: the file (``.gz`` is decompressed on the fly).

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        ValueError: an empty file, a line that is not UTF-8, a row with the wrong number of fields,
            an empty text or label, an unknown split name, a header without rows
            (``path:line: message``, or ``path: message`` for the whole file).
    """
    source = str(path)
    texts: list[str] = []
    labels: list[str] = []
    lines: list[int] = []
    splits: list[str] = []
    columns: dict[str, int] | None = None
    width = 2
    seen_first = False
    for number, line in read_lines(path, what="classification data file"):
        if not line.strip():
            continue
        fields = line.split("\t")
        if not seen_first:
            seen_first = True
            columns = _header_columns(fields)
            if columns is not None:
                width = len(fields)
                continue
        if len(fields) != width:
            expected = ("text<TAB>label" if columns is None
                        else "as many as the header: " + ", ".join(sorted(columns, key=columns.get)))
            raise data_error(source, f"expected {width} tab-separated fields ({expected}), got "
                                     f"{len(fields)}", line=number)
        text = fields[columns["text"] if columns else 0].strip()
        label = fields[columns["label"] if columns else 1].strip()
        if not text:
            raise data_error(source, "empty text", line=number)
        if not label:
            raise data_error(source, "empty label", line=number)
        if columns is not None and "split" in columns:
            split = fields[columns["split"]].strip()
            if split not in SPLITS:
                raise data_error(source, f"unknown split {split!r} (expected one of "
                                         f"{', '.join(SPLITS)})", line=number)
            splits.append(split)
        texts.append(text)
        labels.append(label)
        lines.append(number)
    if not seen_first:
        raise data_error(source, "the file is empty (expected rows of text<TAB>label)")
    if not texts:
        raise data_error(source, "the file has a header but no rows")
    has_split = columns is not None and "split" in columns
    return LabelledTexts(texts=tuple(texts), labels=tuple(labels), lines=tuple(lines),
                         splits=tuple(splits) if has_split else None, source=source)
