"""Training on several processes with ``torch.distributed``: DDP, FSDP2, batch sharding, metrics.

The trainer talks to the process group only through ``Parallel``; with one process every method is
a no-op, so single-process training is unchanged. Joining and leaving the process group is
``process_group.py``; the checks that every rank was launched alike are ``rank_agreement.py``.
Launch with torchrun (see docs/distributed.md)::

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
from typing import Any

import torch
from torch import Tensor, nn
from torch import distributed as dist

# The per-layer wrappers that Parallel.wrap applies.
from aiayn.training.layer_wrappers import (apply_activation_checkpointing, compile_layers,
                                           transformer_layers)
from aiayn.training.rank_agreement import check_agreement
from aiayn.training.weights import assign_weights

STRATEGIES = ("ddp", "fsdp")


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
        """Apply activation checkpointing, DDP/FSDP and, under DDP/FSDP, ``torch.compile`` of each
        layer (``compile_layers``; one process compiles the task's loss instead: ``Trainer``), in
        this order; return the module to train. Weights must already be loaded (FSDP shards what
        is there)."""
        self.module = module
        if activation_checkpointing and not apply_activation_checkpointing(module):
            raise ValueError("activation_checkpointing: the model has no encoder/decoder layers")
        if self.strategy == "fsdp":
            try:
                from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
            except ImportError:
                raise RuntimeError(f"distributed='fsdp' needs torch.distributed.fsdp.fully_shard "
                                   f"(PyTorch >= 2.6); this is torch {torch.__version__}. Use "
                                   f"distributed='ddp'") from None
            if self.main:
                self._shadow = copy.deepcopy(module).cpu()
            for layer in transformer_layers(module):
                fully_shard(layer)
            fully_shard(module)
            # FSDP gathers the parameters around forward only; a task may run the model through
            # another entry point: hidden_states (the losses that project only some positions, or
            # in chunks on the CPU), encode and decode (decoding at validation).
            for method in ("hidden_states", "encode", "decode"):
                if hasattr(module, method):
                    register_fsdp_forward_method(module, method)
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

    def load_full_weights(self, tensors: dict[str, Tensor] | None, *, source: str) -> None:
        """Assign full weights (safetensors names, as ``assign_weights`` takes them) to the model
        being trained. Under FSDP a collective: rank 0 passes the weights, the other ranks None,
        and each rank keeps its shard of them; rank 0's ``full_model`` holds them too."""
        if self.strategy != "fsdp":
            assign_weights(self.module, tensors, source=source)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():  # the root keeps its parameters whole after an
            if isinstance(module, FSDPModule):  # evaluation's forward: shard them to load shards
                module.reshard()
        state: dict[str, Tensor] = {}
        if self.main:  # every name of a tied matrix, as the sharded model's state_dict has them
            assign_weights(self._shadow, tensors, source=source)
            state = self._shadow.state_dict()
        set_model_state_dict(self.model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))

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
        elif hasattr(nn.utils, "get_total_norm"):  # torch >= 2.6
            norm = nn.utils.get_total_norm(grads)
        else:  # older torch has no FSDP2 either, so the gradients are plain tensors
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])
                                            if grads else torch.zeros(1))
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
        """Raise on every rank if the ranks disagree on any of ``parts`` (``rank_agreement``)."""
        if self.active:
            check_agreement(parts, world_size=self.world_size, device=self._comm_device)


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed of rank > 0 from ``step`` on: its own dropout stream, reproducible on resume
    (rank 0 keeps the seed and RNG state of a one-process run, saved in the checkpoint)."""
    return (seed * 1_000_003 + rank * 7_919 + step) % (2**63 - 1)
