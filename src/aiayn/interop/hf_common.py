"""Hugging Face checkpoint directories: reading them, and the parameter-name maps (writing:
``aiayn.interop.hf_export``).

A checkpoint directory holds ``config.json`` and the weights as ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``, or a legacy ``pytorch_model.bin`` read with ``weights_only=True``).
Nothing here imports ``transformers``: the files are read directly.

A family (BERT, GPT-2, Marian/BART) describes its weights as a list of ``Rule``s, one per aiayn
parameter, with ``{}`` standing for the layer index (torchtune's ``convert_weights`` style). The same
rules load (HF -> aiayn, here) and export (aiayn -> HF, ``hf_export``). Loading is strict: every
checkpoint key is used or explicitly ignored, every aiayn parameter is filled (or explicitly new),
and every shape is checked.

Legend: D model width, V vocabulary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"

LAYOUTS = ("same", "transpose", "row", "plus_one")


@dataclass(frozen=True)
class Rule:
    """One aiayn parameter and where its values live in an HF checkpoint.

    Attributes:
        target: aiayn parameter name; ``{}`` is the layer index when ``layers`` > 0.
        sources: HF key(s); several are concatenated along dim 0 in order (BERT's query, key, value
            -> aiayn's fused ``qkv_proj``); ``{}`` as in ``target``.
        layers: how many layers the ``{}`` runs over (0: no placeholder).
        layout: ``"same"``; ``"transpose"`` for GPT-2's Conv1D, which stores (in, out);
            ``"row"`` for a (1, V) buffer that is a (V,) vector in aiayn (``final_logits_bias``);
            ``"plus_one"`` for Gemma's RMSNorm, which stores w and scales by 1 + w (aiayn stores
            the gain 1 + w, computed in float32 as Gemma computes it).
        sizes: rows of each source along dim 0 when they differ (grouped-query attention's q | k | v
            in a fused ``qkv_proj``); None: equal parts.
        rows: the target is rows [start, stop) of its one source, a fused HF tensor that fills
            several aiayn parameters (Phi-3's ``gate_up_proj`` -> ``gate_proj`` and ``up_proj``);
            the rules that share a source must cover its rows exactly. None: the whole source.
    """

    target: str
    sources: tuple[str, ...]
    layers: int = 0
    layout: str = "same"
    sizes: tuple[int, ...] | None = None
    rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.rows is not None and (len(self.sources) != 1 or not 0 <= self.rows[0]
                                      < self.rows[1]):
            raise ValueError(f"rule for {self.target!r}: rows=(start, stop) takes one source and "
                             f"0 <= start < stop, got {self.rows!r} of {len(self.sources)}")
        placeholders = [name.count("{}") for name in (self.target, *self.sources)]
        if any(count != (1 if self.layers else 0) for count in placeholders):
            raise ValueError(f"rule for {self.target!r}: '{{}}' must appear once in every name "
                             f"exactly when layers > 0")

    def expand(self) -> list["Rule"]:
        if not self.layers:
            return [self]
        return [Rule(self.target.format(i), tuple(s.format(i) for s in self.sources),
                     layout=self.layout, sizes=self.sizes, rows=self.rows)
                for i in range(self.layers)]


@dataclass
class NameMap:
    """A family's full description of one checkpoint layout.

    Attributes:
        rules: one per aiayn parameter (tied aiayn parameters may each have a rule; they must agree).
        ties: groups of HF keys that hold one tensor in HF (e.g. ``lm_head.weight`` and
            ``transformer.wte.weight``); the first key is the one rules name and the one written.
            A checkpoint may hold any non-empty subset of a group; the keys it holds must be equal.
        ignore: regular expressions of HF keys that hold no learned weights (old buffers such as
            ``embeddings.position_ids`` or GPT-2's ``attn.bias`` causal mask); they are skipped.
        constants: HF keys that must hold a known tensor if present (Marian's sinusoid table).
        new: aiayn parameters that this checkpoint cannot fill (a head it does not have, e.g. a
            classifier on top of ``BertModel``); they keep their fresh initialisation.
        dropped: HF keys this model has no place for (e.g. ``cls.*`` when loading a masked-LM
            checkpoint into a bare encoder); they are skipped on purpose, listed in the docs.
    """

    rules: list[Rule]
    ties: list[tuple[str, ...]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    constants: dict[str, Tensor] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def expanded(self) -> list[Rule]:
        return [rule for template in self.rules for rule in template.expand()]


@dataclass
class Checkpoint:
    """An HF directory read into memory: its config, its tensors and the file each tensor came from."""

    directory: Path
    config: dict[str, Any]
    tensors: dict[str, Tensor]
    files: dict[str, Path]

    def file_of(self, key: str) -> Path:
        return self.files.get(key, self.directory)


def require_fields(config: Any, required: dict[str, Any], family: str, *,
                   subject: str | None = None) -> None:
    """Raise unless each config field of ``required`` has its value: an export names the first
    field the HF family cannot express ("cannot export as {family}: {subject} needs ...";
    ``subject`` defaults to the family)."""
    for name, value in required.items():
        if getattr(config, name) != value:
            raise ValueError(f"cannot export as {family}: {subject or family} needs "
                             f"{name}={value!r}, the model has {name}={getattr(config, name)!r}")


# --- reading -------------------------------------------------------------------------------------
def read_config(directory: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF checkpoint directory.

    Raises:
        FileNotFoundError: the directory or its config.json does not exist.
        NotADirectoryError: ``directory`` is a file.
        ValueError: config.json is not a JSON object.
    """
    directory = Path(directory)
    if directory.is_file():
        raise NotADirectoryError(f"{directory} is a file; expected a Hugging Face checkpoint "
                                 f"directory (config.json + weights)")
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (an HF checkpoint directory needs config.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a JSON object")
    return data


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if path.stat().st_size < 8:
        raise ValueError(f"{path}: truncated safetensors file ({path.stat().st_size} bytes)")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        from aiayn.training.weights import pickle_hint

        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt "
                         f"({error}){pickle_hint(path)}") from None


def read_weights(directory: str | Path) -> tuple[dict[str, Tensor], dict[str, Path]]:
    """All tensors of an HF checkpoint directory and the file each came from.

    Looks for ``model.safetensors``, then ``model.safetensors.index.json`` (shards), then
    ``pytorch_model.bin`` (read with ``torch.load(weights_only=True)``: never unpickles code).

    Raises:
        FileNotFoundError: no weights file, or a shard named by the index is missing.
        ValueError: a file is truncated or corrupt, or the index is malformed.
    """
    directory = Path(directory)
    single = directory / SAFETENSORS_FILE
    if single.is_file():
        tensors = _read_safetensors(single)
        return tensors, {key: single for key in tensors}
    index = directory / SAFETENSORS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index}: malformed shard index ({error!r})") from None
        tensors, files = {}, {}
        for shard in shards:
            path = directory / shard
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing (listed in {index})")
            part = _read_safetensors(path)
            tensors.update(part)
            files.update({key: path for key in part})
        return tensors, files
    legacy = directory / PYTORCH_FILE
    if legacy.is_file():
        try:
            state = torch.load(legacy, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises many types for a corrupt or unsafe pickle
            # torch's message is a page of advice; keep the line that says what it refused.
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            reason = next((line for line in lines if "Unsupported" in line or "GLOBAL" in line),
                          lines[0] if lines else type(error).__name__)
            raise ValueError(f"{legacy}: not a readable weights-only PyTorch file, refused ({reason}); "
                             f"aiayn never unpickles code: convert it to {SAFETENSORS_FILE}") from None
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise ValueError(f"{legacy}: expected a flat dict of tensors")
        return state, {key: legacy for key in state}
    raise FileNotFoundError(f"{directory}: no weights found (looked for {SAFETENSORS_FILE}, "
                            f"{SAFETENSORS_INDEX_FILE}, {PYTORCH_FILE})")


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """config.json and the weights of an HF checkpoint directory (see ``read_weights``)."""
    config = read_config(directory)
    tensors, files = read_weights(directory)
    return Checkpoint(Path(directory), config, tensors, files)


# --- loading through a name map ------------------------------------------------------------------
def _resolve_ties(checkpoint: Checkpoint, ties: list[tuple[str, ...]]) -> tuple[dict[str, Tensor],
                                                                                  set[str]]:
    """Tensors with every tie group folded onto its first key; also the keys the ties used."""
    tensors = dict(checkpoint.tensors)
    used: set[str] = set()
    for group in ties:
        present = [key for key in group if key in tensors]
        if not present:
            continue
        first = tensors[present[0]]
        for key in present[1:]:
            if tensors[key].shape != first.shape or not torch.equal(tensors[key], first):
                raise ValueError(
                    f"{checkpoint.file_of(key)}: {key!r} differs from {present[0]!r}, but the config "
                    f"ties them (tie_word_embeddings); untie them in config.json or fix the weights")
        for key in present:
            used.add(key)
            tensors.pop(key)
        tensors[group[0]] = first
    return tensors, used


def _from_layout(value: Tensor, layout: str) -> Tensor:
    if layout == "transpose":
        return value.t()
    if layout == "row":
        return value.reshape(-1) if value.dim() == 2 and value.shape[0] == 1 else value
    if layout == "plus_one":
        return 1.0 + value.float()
    return value


def to_layout(value: Tensor, layout: str) -> Tensor:
    if layout == "transpose":
        return value.t()
    if layout == "row":
        return value.reshape(1, -1)
    if layout == "plus_one":  # back to w = gain - 1 (each case undoes _from_layout's)
        return value.float() - 1.0
    return value


def load_state(model: nn.Module, checkpoint: Checkpoint, name_map: NameMap) -> None:
    """Copy a checkpoint's tensors into ``model`` through ``name_map``; strict in both directions.

    Raises:
        ValueError: a missing key, an unexpected key, a shape mismatch, or tied keys that differ;
            the message names the file and the key.
    """
    tensors, used = _resolve_ties(checkpoint, name_map.ties)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    targets = {**dict(model.named_buffers()), **parameters}  # a fixed output bias is a buffer
    filled: dict[int, str] = {}  # id(parameter) -> target name that filled it
    split: dict[str, list[tuple[int, int, str]]] = {}  # fused key -> (start, stop, target)
    ignore = [re.compile(pattern) for pattern in name_map.ignore]
    with torch.no_grad():
        for rule in name_map.expanded():
            if rule.target not in targets:
                raise ValueError(f"name map error: aiayn model has no parameter {rule.target!r}")
            parameter = targets[rule.target]
            parts = []
            for key in rule.sources:
                if key not in tensors:
                    raise ValueError(f"{checkpoint.directory}: missing key {key!r} (needed for aiayn "
                                     f"parameter {rule.target!r}); the checkpoint holds "
                                     f"{len(checkpoint.tensors)} tensors")
                part = _from_layout(tensors[key], rule.layout)
                if rule.rows is not None:  # one block of a fused tensor
                    split.setdefault(key, []).append((*rule.rows, rule.target))
                    part = part[rule.rows[0]:rule.rows[1]]
                parts.append(part)
                used.add(key)
            try:
                value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            except RuntimeError:
                value = None
            if value is None or value.shape != parameter.shape:
                shapes = ", ".join(f"{key!r} {tuple(checkpoint.tensors.get(key, tensors[key]).shape)}"
                                   for key in rule.sources)
                raise ValueError(f"{checkpoint.file_of(rule.sources[0])}: shape mismatch for "
                                 f"{shapes} -> aiayn {rule.target!r} {tuple(parameter.shape)} "
                                 f"(does config.json match the weights?)")
            if id(parameter) in filled and not torch.equal(parameter, value.to(parameter.dtype)):
                raise ValueError(f"{checkpoint.file_of(rule.sources[0])}: {rule.sources} must equal "
                                 f"the tensor already loaded into {filled[id(parameter)]!r} (tied)")
            parameter.copy_(value)
            filled.setdefault(id(parameter), rule.target)
    for key, blocks in split.items():
        _check_rows(checkpoint, key, tensors[key].shape[0], blocks)
    for key, expected in name_map.constants.items():
        if key in tensors:
            used.add(key)
            value = tensors[key]
            if value.shape != expected.shape or not torch.allclose(value.float(), expected,
                                                                   atol=1e-4):
                raise ValueError(f"{checkpoint.file_of(key)}: {key!r} is not the fixed table aiayn "
                                 f"computes (shape {tuple(value.shape)} vs {tuple(expected.shape)})")
    dropped = [re.compile(pattern) for pattern in name_map.dropped]
    unexpected = sorted(key for key in tensors if key not in used
                        and not any(p.fullmatch(key) for p in ignore + dropped))
    if unexpected:
        shown = ", ".join(repr(key) for key in unexpected[:8])
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise ValueError(f"{checkpoint.file_of(unexpected[0])}: unexpected key(s) {shown}{more}: "
                         f"the config describes no such weights (wrong architecture or config?)")
    new = set(name_map.new)
    unfilled = sorted(name for name, p in parameters.items()
                      if id(p) not in filled and name not in new)
    if unfilled:
        raise ValueError(f"name map error: aiayn parameters not filled from {checkpoint.directory}: "
                         f"{unfilled}")


def tiled_rows(ranges: list[tuple[int, int]]) -> int | None:
    """The rows that row ranges [start, stop) cover when, sorted, they run on from row 0
    without gaps or overlaps; else None."""
    covered = 0
    for start, stop in sorted(ranges):
        if start != covered:
            return None
        covered = stop
    return covered


def _check_rows(checkpoint: Checkpoint, key: str, rows: int,
                blocks: list[tuple[int, int, str]]) -> None:
    """The blocks that rules take from a fused tensor of ``rows`` rows tile it, without gaps."""
    blocks = sorted(blocks)
    if tiled_rows([(start, stop) for start, stop, _ in blocks]) != rows:
        taken = ", ".join(f"{target!r} rows {start}:{stop}" for start, stop, target in blocks)
        raise ValueError(f"{checkpoint.file_of(key)}: {key!r} has {rows} rows, but aiayn takes "
                         f"{taken} (does config.json match the weights?)")


def require(config: dict[str, Any], key: str, source: Path, kind: type | tuple = int) -> Any:
    """``config[key]``, which must exist and have the given type."""
    if key not in config:
        raise ValueError(f"{source / CONFIG_FILE}: missing field {key!r}")
    value = config[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ValueError(f"{source / CONFIG_FILE}: field {key!r} has the wrong type ({value!r})")
    return value


def build_config(fields: dict[str, Any], source: Path):
    """``TransformerConfig(**fields)``, its errors prefixed with the config.json they came from."""
    from aiayn.config import TransformerConfig

    try:
        return TransformerConfig(**fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source / CONFIG_FILE}: {error}") from None


# HF activation names -> aiayn's config.activation. gelu_new / gelu_pytorch_tanh / gelu_fast are the
# tanh approximation (equal to within float rounding); "swish" is SiLU.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu",
                  "silu": "silu", "swish": "silu"}
AIAYN_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "swish"}


def activation_from_hf(name: Any, field_name: str, source: Path) -> str:
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"{source / CONFIG_FILE}: {field_name}={name!r} is not supported; aiayn "
                         f"supports {sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]
