"""Writing an aiayn model as a Hugging Face checkpoint directory: the HF state dict through a
family's name map (the inverse of ``hf_common.load_state``), then ``config.json`` and
``model.safetensors``, each written atomically (a temporary file, fsync, rename).

Legend: D model width.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.interop.hf_common import (CONFIG_FILE, SAFETENSORS_FILE, NameMap, tiled_rows,
                                     to_layout)


def export_state(model: nn.Module, name_map: NameMap) -> dict[str, Tensor]:
    """The HF state dict of ``model`` (inverse of ``load_state``); each tie group under its first key."""
    parameters = {**dict(model.named_buffers()),  # a fixed output bias is a buffer
                  **dict(model.named_parameters(remove_duplicate=False))}
    state: dict[str, Tensor] = {}
    fused: dict[str, list[tuple[tuple[int, int], Tensor]]] = {}  # key -> its blocks (``rows``)
    for rule in name_map.expanded():
        value = parameters[rule.target].detach()
        if rule.rows is not None:
            fused.setdefault(rule.sources[0], []).append((rule.rows,
                                                          to_layout(value, rule.layout)))
            continue
        if rule.sizes is not None:
            parts = value.split(rule.sizes, dim=0)
        else:
            parts = value.chunk(len(rule.sources), dim=0) if len(rule.sources) > 1 else (value,)
        for key, part in zip(rule.sources, parts):
            tensor = to_layout(part, rule.layout).contiguous().clone()
            if key in state and not torch.equal(state[key], tensor):
                raise ValueError(f"name map error: two different tensors for HF key {key!r}")
            state[key] = tensor
    for key, blocks in fused.items():
        blocks.sort(key=lambda block: block[0])
        if tiled_rows([rows for rows, _ in blocks]) is None or any(
                len(part) != stop - start for (start, stop), part in blocks):
            raise ValueError(f"name map error: the blocks of HF key {key!r} do not tile it "
                             f"({[rows for rows, _ in blocks]})")
        state[key] = torch.cat([part for _, part in blocks], dim=0).contiguous().clone()
    return state


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same directory, fsync, rename: never half-written."""
    from aiayn.training.checkpoint import usual_permissions

    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(temporary)
        usual_permissions(temporary)  # after: a writer may make a file of its own
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def write_checkpoint(directory: str | Path, config: dict[str, Any],
                     tensors: dict[str, Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _atomic_write(directory / SAFETENSORS_FILE,
                  lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _atomic_write(directory / CONFIG_FILE,
                  lambda path: Path(path).write_text(text, encoding="utf-8"))
