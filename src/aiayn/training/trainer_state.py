"""The trainer's state besides the weights, as safetensors tensors plus JSON (no pickle): the
optimizer's state_dict and the RNG states of torch, CUDA, Python and NumPy. A checkpoint stores both
(``checkpoint.write_checkpoint``), so a resumed run continues bit-identically."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor


def seed_all(seed: int) -> None:
    """Seed torch's, Python's and NumPy's generators (the three a checkpoint saves)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def capture_rng() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """RNG states of torch (CPU and CUDA), Python and NumPy as (tensors, JSON)."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{index}"] = state
    kind, keys, position, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    version, internal, gauss = random.getstate()
    meta = {"numpy": [kind, int(position), int(has_gauss), float(cached)],
            "python": [version, list(internal), gauss]}
    return tensors, meta


def restore_rng(tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    cuda = [tensors[key] for key in sorted(k for k in tensors if k.startswith("rng/cuda/"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    kind, position, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), position,
                         has_gauss, cached))
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def optimizer_to_tensors(optimizer: torch.optim.Optimizer, *,
                         state_dict: Mapping[str, Any] | None = None
                         ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split an optimizer state_dict (default: ``optimizer.state_dict()``; a distributed run
    passes the full one gathered from the shards) into safetensors-able tensors and JSON."""
    if state_dict is None:
        state_dict = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, slots in state_dict["state"].items():
        for slot, value in slots.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer/{index}/{slot}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[slot] = value
    groups = [{key: (list(value) if isinstance(value, tuple) else value)
               for key, value in group.items()} for group in state_dict["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: Mapping[str, Tensor],
                           meta: Mapping[str, Any], *,
                           load: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Rebuild the state_dict written by ``optimizer_to_tensors`` and load it (``load``: how, e.g.
    into FSDP-sharded parameters; default ``optimizer.load_state_dict``)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, index, slot = key.split("/", 2)
            state.setdefault(int(index), {})[slot] = value
    for index, slots in meta["scalars"].items():
        state.setdefault(int(index), {}).update(slots)
    groups = [{key: (tuple(value) if key == "betas" else value) for key, value in group.items()}
              for group in meta["param_groups"]]
    (load or optimizer.load_state_dict)({"state": state, "param_groups": groups})
