"""Skipping the padding of a batch: its real tokens, back to back.

Everything in an encoder layer except attention works on each position alone (the projections, the
FFN, LayerNorm, the residual adds), so a padded batch x (B, T, D) can run all of it on its N real
tokens only, packed as (1, N, D), with attention called once per sequence on that sequence's slice.
The padded positions' share of the products' FLOPs is saved, and more than that share of attention's
(a sequence of length L attends over L keys, not T). ``torch.nn.TransformerEncoder``'s inference fast
path does the same with nested tensors; Hugging Face's BERT computes every padded position.

Outputs at real positions equal the padded computation's up to summation order. At padded positions
they are zero: never computed (the padded computation fills them with values that mean nothing, which
every consumer masks out: pooling, the losses, cross-attention). So do gradients: no real position
ever depended on a padded one. In training, dropout draws its masks for the N packed rows instead of
the B * T padded ones (the same distribution, another random stream).

Used by ``aiayn.stacks.Encoder`` when ``applies``: CPU (measured there; on a GPU the per-sequence
attention calls are one launch each), outside a ``torch.compile`` trace (the packed length depends
on the data; ``aiayn.training.distributed.compile_layers`` turns it off for the encoders whose layers
it compiles, which would otherwise recompile for every batch), at least
``MIN_PADDED_FRACTION`` of the positions padding, and attention kernels whose result for a sequence
does not depend on where it sits (``AttentionKernel.uses_positions`` False: not the sparse patterns,
whose blocks are laid out by absolute position). ``enabled = False`` switches it off.

Measured (2 threads, AMD EPYC Zen 4, all-MiniLM-L6-v2 shapes: d 384, 6 layers, batch 32, length 128,
lengths uniform in 96..128, so 13 % padding): see docs/performance.md, eighth pass.

Legend: B batch, T length, N real tokens (N <= B * T), D model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

enabled = True  # module switch (tests and A/B benchmarks turn it off)
# Below this share of padding the per-sequence attention calls cost about what the products save.
MIN_PADDED_FRACTION = 1 / 16


@dataclass(frozen=True)
class PackedBatch:
    """Where the real tokens of a padded (B, T) batch went.

    ``rows``: (N,) flat positions b * T + t of the real tokens, in order; ``offsets``: (B + 1,)
    sequence b is packed rows offsets[b] .. offsets[b + 1].
    """

    rows: Tensor
    offsets: list[int]
    batch: int
    length: int

    @property
    def tokens(self) -> int:
        return self.rows.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Real tokens per sequence (B,)."""
        return [end - start for start, end in zip(self.offsets[:-1], self.offsets[1:])]

    def positions(self, sequence: int) -> Tensor:
        """(L,) where the packed tokens of ``sequence`` sit in its padded row."""
        start, end = self.offsets[sequence], self.offsets[sequence + 1]
        return self.rows[start:end] - sequence * self.length


def applies(padding_mask: Tensor, uses_positions: bool) -> bool:
    """Whether an encoder forward with this (B, T) padding mask runs packed (see the module doc)."""
    if (not enabled or uses_positions or padding_mask.device.type != "cpu"
            or torch.compiler.is_compiling()):  # data-dependent shapes would break the graph
        return False
    padded = padding_mask.numel() - int(padding_mask.sum())
    return padded >= MIN_PADDED_FRACTION * padding_mask.numel() and padded < padding_mask.numel()


def pack(x: Tensor, padding_mask: Tensor) -> tuple[Tensor, PackedBatch]:
    """x (B, T, D), padding_mask (B, T) True = real -> the real rows (1, N, D) and where they were."""
    batch, length, width = x.shape
    rows = padding_mask.reshape(-1).nonzero().squeeze(1)  # (N,)
    offsets = [0] + padding_mask.sum(dim=1).cumsum(0).tolist()  # (B + 1,)
    packed = x.reshape(batch * length, width).index_select(0, rows)  # (N, D)
    return packed.unsqueeze(0), PackedBatch(rows, offsets, batch, length)  # (1, N, D)


def unpack(packed: Tensor, where: PackedBatch) -> Tensor:
    """(1, N, D) -> (B, T, D), zeros at the padded positions."""
    width = packed.shape[-1]
    out = packed.new_zeros(where.batch * where.length, width)  # (B*T, D)
    out.index_copy_(0, where.rows, packed[0])
    return out.view(where.batch, where.length, width)  # (B, T, D)
