"""The label vocabulary of a classifier: label strings <-> class indices, saved with the model.

Class ``i`` of the model's output is ``labels[i]``; the order is sorted, so the same training labels
always give the same indices whatever the row order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LABELS_FILE = "labels.json"


@dataclass(frozen=True)
class LabelMap:
    """Class names in model output order.

    Example:
        >>> labels = LabelMap.from_labels(["net", "admin", "net"])
        >>> labels.names, labels.index("net"), labels.name(0)
        (('admin', 'net'), 1, 'admin')
    """

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a label map needs at least one label")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate labels in {list(self.names)}")
        for name in self.names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"labels must be non-empty strings, got {name!r}")
        object.__setattr__(self, "_index", {name: i for i, name in enumerate(self.names)})

    @classmethod
    def from_labels(cls, labels: Iterable[str]) -> "LabelMap":
        """The sorted distinct labels of the training rows."""
        return cls(tuple(sorted(set(labels))))

    def __len__(self) -> int:
        return len(self.names)

    def index(self, label: str, *, where: str = "") -> int:
        """The class index of ``label``.

        Raises:
            ValueError: a label the model was not trained on (``where`` says where it came from).
        """
        try:
            return self._index[label]
        except KeyError:
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}unknown label {label!r}; the model knows "
                             f"{len(self.names)} labels: {', '.join(self.names)}") from None

    def name(self, index: int) -> str:
        return self.names[index]

    def save(self, path: str | Path) -> None:
        """Write ``{"labels": [...]}`` atomically."""
        from aiayn.training.checkpoint import atomic_write_json

        atomic_write_json(path, {"labels": list(self.names)})

    @classmethod
    def load(cls, path: str | Path) -> "LabelMap":
        """Read a file written by ``save``.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a label file (bad JSON, no ``labels`` list, duplicates).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"label file not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: corrupt label file ({error})") from None
        if not isinstance(data, dict) or not isinstance(data.get("labels"), list):
            raise ValueError(f"{path}: corrupt label file (expected {{\"labels\": [...]}})")
        try:
            return cls(tuple(data["labels"]))
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
