"""Unlabelled texts for masked-LM pretraining: one text per non-blank line of a UTF-8 file.

A ``.tsv`` / ``.tsv.gz`` file with a header naming a ``text`` column contributes that column (so the
labelled classification data can be pretrained on without its labels). The file is read through
``aiayn.data.text_files`` (errors as ``path:line: message``).
"""

from __future__ import annotations

from pathlib import Path

from aiayn.data.text_files import data_error, read_lines


def read_texts(path: str | Path) -> tuple[str, ...]:
    """The texts of ``path`` (see the module docstring).

    Raises:
        FileNotFoundError / IsADirectoryError: no such file / a directory.
        ValueError: an empty file, a line that is not UTF-8, a TSV row with the wrong field count.
    """
    path = Path(path)
    is_tsv = path.name.endswith((".tsv", ".tsv.gz"))
    texts: list[str] = []
    column: int | None = None
    width = 0
    first = True
    for number, line in read_lines(path, what="text file"):
        if not line.strip():
            continue
        if is_tsv:
            fields = line.split("\t")
            if first:
                first = False
                names = [field.strip().lower() for field in fields]
                if "text" not in names:
                    raise data_error(path, "a TSV corpus needs a header row naming a 'text' "
                                           "column", line=number)
                column, width = names.index("text"), len(fields)
                continue
            if len(fields) != width:
                raise data_error(path, f"expected {width} tab-separated fields like the header, "
                                       f"got {len(fields)}", line=number)
            text = fields[column].strip()
        else:
            text = line.strip()
        if text:
            texts.append(text)
    if not texts:
        raise data_error(path, "the file is empty (no text lines)")
    return tuple(texts)
