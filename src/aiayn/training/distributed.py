"""Training on several processes with ``torch.distributed``: DDP, FSDP2, batch sharding, metrics.

The trainer talks to the process group only through ``Parallel``; with one process every method is
a no-op, so single-process training is unchanged. Launch with torchrun (see docs/distributed.md)::

    torchrun --nproc-per-node 4 -m aiayn train lm --data input.txt --out runs/lm

What is sharded, and how:

* Data: every rank walks the SAME global stream of the task's batches (epoch after epoch; the task's
  batches are deterministic in (seed, epoch)). An optimizer step takes the next ``W * A`` batches of
  the stream (W ranks, A = ``accumulation``) and rank r keeps batches r, r + W, r + 2W, ... of them.
  A step may straddle an epoch boundary, so no batch is ever dropped or duplicated, every rank runs
  the same number of steps, and the data position saved in a checkpoint (epoch, batch index) is the
  same on every rank and independent of W. The price: each rank materialises (collates) the batches
  of the other ranks and throws them away; it never runs the model on them.
* Gradients: each rank's loss is a SUM over its units; it is divided by the GLOBAL unit count of the
  step (an all-reduce of the per-rank counts) and multiplied by W, because DDP and FSDP average the
  gradients over ranks. So W processes with accumulation A compute the gradient of one process with
  accumulation W * A, up to float summation order. Micro-steps but the last skip the gradient
  all-reduce (DDP ``no_sync``, FSDP ``set_requires_gradient_sync(False)``).
* Parameters: "ddp" replicates the model (DistributedDataParallel); "fsdp" shards parameters,
  gradients and optimizer state over ranks (``torch.distributed.fsdp.fully_shard``, FSDP2: one unit
  per encoder/decoder layer plus the root for embeddings and heads). Checkpoints always hold the
  full, unsharded weights and optimizer state (gathered on rank 0): any world size resumes them.
* Files: only rank 0 writes logs, checkpoints and run.json; every rank reads the same checkpoint
  when resuming (the run directory must be on a filesystem every node can read).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn
from torch import distributed as dist

STRATEGIES = ("ddp", "fsdp")


# --- process group lifecycle --------------------------------------------------------------------
def world_size_from_env() -> int:
    """WORLD_SIZE set by torchrun (1 when launched as a plain process)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") \
            from None


def rank_device(device: str | None) -> str:
    """The device this rank trains on: "cuda" (or None with a GPU) becomes cuda:LOCAL_RANK."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    parsed = torch.device(device)
    if parsed.type == "cuda" and parsed.index is None:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


@contextlib.contextmanager
def process_group_from_env(*, device: str | None, timeout_s: float = 1800.0
                           ) -> Iterator[str | None]:
    """Initialise the default process group from torchrun's environment for the block, and destroy
    it when the block exits, also on an error (so a failing rank never leaves its peers hanging
    longer than ``timeout_s``).

    Without torchrun (WORLD_SIZE unset or 1) nothing happens and ``device`` is yielded unchanged.
    Otherwise the backend is NCCL for CUDA devices and gloo for the CPU, and the yielded device is
    this rank's (cuda:LOCAL_RANK).

    Args:
        device: "cpu", "cuda", "cuda:1", ... or None (cuda if available).
        timeout_s: how long a collective waits for a missing rank before failing.

    Raises:
        ValueError: a non-positive timeout or a malformed torchrun environment.
        RuntimeError: torch.distributed is not available in this build.
    """
    if not timeout_s > 0:
        raise ValueError(f"the process group timeout must be positive, got {timeout_s!r}")
    if world_size_from_env() <= 1 or (dist.is_available() and dist.is_initialized()):
        yield device
        return
    if not dist.is_available():
        raise RuntimeError("this PyTorch build has no torch.distributed; install one that has it")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"WORLD_SIZE is set but {name} is not: launch with torchrun")
    device = rank_device(device)
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    try:
        yield device
    finally:
        dist.destroy_process_group()


# --- per-layer wrappers -------------------------------------------------------------------------
def transformer_layers(module: nn.Module) -> list[nn.Module]:
    """The encoder/decoder layers of an aiayn model (the units of checkpointing and sharding)."""
    from aiayn.nn.layers import DecoderLayer, EncoderLayer

    return [m for m in module.modules() if isinstance(m, (EncoderLayer, DecoderLayer))]


def compile_layers(module: nn.Module) -> int:
    """``torch.compile`` each encoder/decoder layer in place (regional compilation); return how many.

    Not the whole model: a compiled model call returns the logits, so the task losses would have to
    take that call and lose the chunked output projection + loss (``aiayn.training.
    linear_cross_entropy``), which never builds the (N, V) logits. Measured (``python3
    benchmarks/run_all.py --compile``, AMD EPYC Zen 4, 2 threads, medians of three runs): the
    compiled whole model 1.12x HF GPT-2's training step, the compiled layers 1.29x (the eager step
    1.31x). Identical layers share compiled code. In float32 CPU training the attention runs between
    two graphs of a layer (``aiayn.nn.attention.gemm_attention.attention_between_graphs``, one graph
    break a layer): 1.016-1.066x the step with SDPA traced into one graph, at the same compile time
    (15-16 s for the first two steps of the benchmark's model with an empty inductor cache).
    """
    from aiayn.nn.stacks import Encoder

    layers = transformer_layers(module)
    if not layers:
        raise ValueError("compile: the model has no encoder/decoder layers")
    for layer in layers:
        layer.compile()
    for encoder in module.modules():
        if isinstance(encoder, Encoder):  # packed lengths vary per batch: one recompile each
            encoder.skips_padding = False
    return len(layers)


def apply_activation_checkpointing(module: nn.Module) -> int:
    """Recompute each layer's activations in the backward pass instead of storing them.

    Trades about one extra forward per layer for activation memory that no longer grows with the
    number of layers. The layer's ``forward`` is replaced in place (parameter names are unchanged,
    so checkpoints stay compatible); dropout masks are replayed exactly (RNG state preserved), so
    loss and gradients equal the plain run's. Inference (no grad, or with a KV cache) runs the plain
    forward. Returns the number of layers wrapped.
    """
    from torch.utils.checkpoint import checkpoint

    layers = transformer_layers(module)
    for layer in layers:
        plain = layer.forward

        def forward(*args: Any, _plain=plain, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or kwargs.get("cache") is not None:
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    return len(layers)


# --- the trainer's view of the process group ----------------------------------------------------
class Parallel:
    """Data/model parallelism hooks for the trainer; no-ops with one process.

    Args:
        strategy: "ddp" or "fsdp" (ignored with one process).
        device: this rank's device.
    """

    def __init__(self, strategy: str, device: torch.device):
        if strategy not in STRATEGIES:
            raise ValueError(f"distributed must be one of {STRATEGIES}, got {strategy!r}")
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.strategy = strategy if self.active else "none"
        self.device = device
        # Collectives run on the device for NCCL, on the CPU for gloo.
        self._comm_device = device if self.active and dist.get_backend() == "nccl" \
            else torch.device("cpu")
        self.module: nn.Module | None = None  # the plain model (shared parameters with .model)
        self.model: nn.Module | None = None   # what the training forward runs on
        self._shadow: nn.Module | None = None  # FSDP, rank 0: full-weight CPU copy for saving

    @property
    def main(self) -> bool:
        return self.rank == 0

    # -- model ---------------------------------------------------------------------------------
    def wrap(self, module: nn.Module, *, activation_checkpointing: bool = False,
             compile: bool = False) -> nn.Module:
        """Apply activation checkpointing, DDP/FSDP and ``torch.compile`` of each layer
        (``compile_layers``), in this order; return the module to train. Weights must already be
        loaded (FSDP shards what is there)."""
        self.module = module
        if activation_checkpointing and not apply_activation_checkpointing(module):
            raise ValueError("activation_checkpointing: the model has no encoder/decoder layers")
        if self.strategy == "fsdp":
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                raise RuntimeError(f"distributed='fsdp' needs torch.distributed.fsdp.fully_shard "
                                   f"(PyTorch >= 2.6); this is torch {torch.__version__}. Use "
                                   f"distributed='ddp'") from None
            if self.main:
                self._shadow = copy.deepcopy(module).cpu()
            for layer in transformer_layers(module):
                fully_shard(layer)
            fully_shard(module)
            if compile:
                compile_layers(module)
            self.model = module
        elif self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            if compile:
                compile_layers(module)
            ids = [self.device.index] if self.device.type == "cuda" else None
            # The only buffers are deterministic tables (positions): no per-forward broadcast
            # (the keyword was renamed in torch 2.13).
            import inspect

            keyword = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
                DistributedDataParallel.__init__).parameters else "broadcast_buffers"
            self.model = DistributedDataParallel(module, device_ids=ids, **{keyword: False})
        else:
            if compile:
                compile_layers(module)
            self.model = module
        return self.model

    @property
    def eval_model(self) -> nn.Module:
        """What evaluation runs on: the plain module (no DDP collectives); FSDP's sharded one."""
        return self.model if self.strategy == "fsdp" else self.module

    def full_model(self) -> nn.Module:
        """A module holding the full weights, for saving (rank 0). Under FSDP this gathers the
        shards: a collective, every rank must call it; other ranks get their sharded module."""
        if self.strategy != "fsdp":
            return self.module
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if not self.main:
            return self.model
        self._shadow.load_state_dict(state)
        return self._shadow

    # -- optimizer state -------------------------------------------------------------------------
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state_dict (parameters numbered as ``optimizer.state_dict()`` does).
        Under FSDP a collective that gathers the sharded moments to rank 0."""
        if self.strategy != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)

        full = get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        if not self.main:
            return {"state": {}, "param_groups": []}
        index, groups, state = 0, [], {}
        for group in full["param_groups"]:
            numbers = []
            for name in group["params"]:
                if name in full["state"]:
                    state[index] = full["state"][name]
                numbers.append(index)
                index += 1
            groups.append({**group, "params": numbers})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  state_dict: dict[str, Any]) -> None:
        """Load a full optimizer state_dict (every rank passes the same one)."""
        if self.strategy != "fsdp":
            optimizer.load_state_dict(state_dict)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict,
                                                             set_optimizer_state_dict)

        names = [name for group in get_optimizer_state_dict(
            self.model, optimizer, options=StateDictOptions(full_state_dict=False)
        )["param_groups"] for name in group["params"]]
        groups, index = [], 0
        for group in state_dict["param_groups"]:
            groups.append({**group, "params": names[index:index + len(group["params"])]})
            index += len(group["params"])
        state = {names[int(number)]: slots for number, slots in state_dict["state"].items()}
        set_optimizer_state_dict(self.model, optimizer, {"state": state, "param_groups": groups},
                                 options=StateDictOptions(full_state_dict=True))

    # -- the step ------------------------------------------------------------------------------
    def step_batches(self, batches: Any, accumulation: int) -> list[Any]:
        """This rank's micro-batches of the next step: batches r, r + W, ... of the next W * A
        of the global stream (``batches.next()``), so every rank advances the stream alike."""
        mine = []
        for index in range(accumulation * self.world_size):
            batch = batches.next()
            if index % self.world_size == self.rank:
                mine.append(batch)
        return mine

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Context for a micro-step's forward: skip the gradient all-reduce unless ``sync``."""
        if self.strategy == "ddp" and not sync:
            return self.model.no_sync()
        if self.strategy == "fsdp":
            self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    @property
    def gradient_scale(self) -> float:
        """Multiplies each rank's loss: DDP/FSDP average gradients over ranks, we want their sum."""
        return float(self.world_size)

    def global_count(self, units: int) -> int:
        """The sum over ranks of this rank's loss units (one small all-reduce per step)."""
        if not self.active:
            return units
        total = torch.tensor([units], dtype=torch.int64, device=self._comm_device)
        dist.all_reduce(total)
        return int(total.item())

    def sum(self, value: Tensor) -> Tensor:
        """All-reduced sum of a metric tensor (a copy; the input is untouched)."""
        if not self.active:
            return value
        total = value.detach().to(self._comm_device, copy=True)
        dist.all_reduce(total)
        return total.to(value.device)

    def agree(self, flag: bool) -> bool:
        """Rank 0's value of ``flag`` on every rank (e.g. a file test on rank 0's filesystem)."""
        if not self.active:
            return flag
        value = torch.tensor([int(flag)], device=self._comm_device)
        dist.broadcast(value, src=0)
        return bool(value.item())

    @staticmethod
    def grad_norm(parameters: list[nn.Parameter], clip: float | None) -> Tensor:
        """The global gradient norm (clipping to ``clip`` first if given); a plain tensor also for
        FSDP's sharded (DTensor) gradients."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if clip is not None:
            norm = nn.utils.clip_grad_norm_(parameters, clip)
        else:
            norm = nn.utils.get_total_norm(grads)
        full = getattr(norm, "full_tensor", None)
        return full() if full is not None else norm

    # -- random state of ranks > 0 -------------------------------------------------------------
    def gather_rng_states(self) -> dict[str, Tensor]:
        """Every rank's torch (and CUDA) RNG state for rank 0's checkpoint, as tensors named
        ``rng/rank{r}/torch`` (rank 0's own state is saved by the trainer as in one process).
        A collective: every rank calls it; other ranks get {}."""
        if not self.active:
            return {}
        states = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        saved = {}
        for kind, state in states.items():
            local = state.to(self._comm_device)
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local)
            saved.update({f"rng/rank{rank}/{kind}": value.cpu()
                          for rank, value in enumerate(gathered) if rank})
        return saved if self.main else {}

    def restore_rank_rng(self, tensors: dict[str, Tensor], *, seed: int, step: int) -> None:
        """On rank r > 0, restore the state saved by ``gather_rng_states`` (exact resume with
        dropout); a checkpoint from fewer ranks has none, then r draws a fresh seeded stream."""
        if not self.rank:
            return
        key = f"rng/rank{self.rank}/torch"
        if key not in tensors:
            torch.manual_seed(rank_seed(seed, self.rank, step))
            return
        torch.set_rng_state(tensors[key])
        cuda = tensors.get(f"rng/rank{self.rank}/cuda")
        if cuda is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(cuda, self.device)

    # -- agreement between ranks -----------------------------------------------------------------
    def check_agreement(self, parts: dict[str, Any]) -> None:
        """Raise on every rank if the ranks disagree on any of ``parts`` (JSON-able values or
        tensors), naming the part and the ranks. One all-gather of 32-byte digests per part."""
        if not self.active:
            return
        names = sorted(parts)
        digests = torch.tensor([list(_digest(parts[name])) for name in names], dtype=torch.uint8,
                               device=self._comm_device)
        gathered = [torch.empty_like(digests) for _ in range(self.world_size)]
        dist.all_gather(gathered, digests)
        problems = []
        for row, name in enumerate(names):
            differ = [rank for rank in range(1, self.world_size)
                      if not torch.equal(gathered[rank][row], gathered[0][row])]
            if differ:
                problems.append(f"{name} (rank(s) {', '.join(map(str, differ))} differ from "
                                f"rank 0)")
        if problems:
            raise ValueError(f"the {self.world_size} ranks disagree on: {'; '.join(problems)}. "
                             f"Launch every rank with the same command, data and run directory")


def _digest(value: Any) -> bytes:
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.digest()


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, dict):
        hasher.update(b"{")
        for key in sorted(value, key=str):
            hasher.update(str(key).encode())
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (str, int, float, bool, type(None))):
        hasher.update(json.dumps(value).encode())
    elif hasattr(value, "__dict__"):  # a batch object: its fields (never its id-based repr)
        hasher.update(type(value).__qualname__.encode())
        _feed(hasher, vars(value))
    else:
        hasher.update(repr(value).encode())


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed of rank > 0 from ``step`` on: its own dropout stream, reproducible on resume
    (rank 0 keeps the seed and RNG state of a one-process run, saved in the checkpoint)."""
    return (seed * 1_000_003 + rank * 7_919 + step) % (2**63 - 1)


def data_fingerprint(task: Any, batches: int = 4) -> Any:
    """What identifies a task's training data cheaply: ``task.fingerprint()`` if the task has one,
    else the contents of the first few batches of epoch 0."""
    fingerprint = getattr(task, "fingerprint", None)
    if callable(fingerprint):
        return fingerprint()
    sample = []
    for index, batch in enumerate(task.train_batches(0)):
        if index == batches:
            break
        sample.append(batch)
    return sample


def parameter_fingerprint(module: nn.Module) -> Tensor:
    """Per-parameter float64 sums and sums of squares: equal initial weights on every rank (FSDP
    shards each rank's own copy, so a rank built from another seed would silently mix models)."""
    with torch.no_grad():
        stats = [torch.stack([p.double().sum(), p.double().square().sum()])
                 for p in module.parameters()]
    return torch.stack(stats).cpu() if stats else torch.zeros(0)
