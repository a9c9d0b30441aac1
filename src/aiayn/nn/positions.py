"""Position information (paper 3.5): the sinusoidal encoding and learned position embeddings.

    PE(pos, 2i)   = sin(pos / 10000^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d_model))

Both modules map positions to (…, D) vectors; the caller adds them to the token embeddings. Positions
are either a contiguous run ``start .. start + T - 1`` (the usual case, a slice of the table) or an
explicit (B, T) tensor (left-padded batches).

Legend: B batch, T length, D model width, P table size (max_length).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(length: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """(P, D) table of the paper's encoding.

    ``layout="interleaved"`` puts sin on even and cos on odd dims as in the paper; ``"split"`` puts all
    sines in the first half and all cosines in the second (the same frequencies; Marian's layout);
    ``"fairseq"`` is tensor2tensor's variant that fairseq, M2M100 and NLLB use: sin | cos halves with
    frequencies 10000^(-i / (D/2 - 1)), i = 0 .. D/2 - 1 (the last one exactly 1/10000, where the
    paper's stops one step short), computed in float32 as transformers' M2M100 computes it.
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    if layout == "fairseq":
        half = d_model // 2
        if half < 2:
            raise ValueError(f"the fairseq sinusoid layout needs d_model >= 4, got {d_model}")
        frequency = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))  # (D/2,)
        angles = torch.arange(length).float().unsqueeze(1) * frequency.unsqueeze(0)  # (P, D/2)
        return torch.cat([angles.sin(), angles.cos()], dim=1)  # (P, D)
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inverse_frequency = torch.exp(  # 1 / 10000^(2i / D), i = 0 .. D/2 - 1
        torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    angles = position * inverse_frequency  # (P, D/2)
    table = torch.empty(length, d_model, dtype=torch.float64)
    if layout == "interleaved":
        table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()
    elif layout == "split":
        table[:, : d_model // 2], table[:, d_model // 2:] = angles.sin(), angles.cos()
    else:
        raise ValueError(f"unknown sinusoid layout {layout!r}; choose 'interleaved', 'split' or "
                         f"'fairseq'")
    return table.float()


class _PositionTable(nn.Module):
    """Shared lookup: contiguous slice or explicit gather, with the length check in one place."""

    max_length: int
    offset: int

    def table(self) -> Tensor:
        raise NotImplementedError

    def forward(self, length: int, start: int = 0, positions: Tensor | None = None) -> Tensor:
        """(T, D) vectors for positions start.., or (B, T, D) for explicit ``positions`` (B, T)."""
        if positions is not None:
            return self.table()[positions + self.offset]
        if start + length > self.max_length:
            raise ValueError(f"sequence of {start + length} positions exceeds the position table "
                             f"(max_length={self.max_length})")
        begin = start + self.offset
        return self.table()[begin: begin + length]


class SinusoidalPositions(_PositionTable):
    """The paper's fixed encoding; a buffer, not a parameter, and not saved in checkpoints.

    ``offset``: position p reads row p + offset of the encoding (fairseq / M2M100 count positions
    from padding_idx + 1: the encoding of 2 for the first token when the pad id is 1).
    """

    def __init__(self, max_length: int, d_model: int, layout: str = "interleaved",
                 offset: int = 0):
        super().__init__()
        self.max_length, self.offset = max_length, offset
        self.register_buffer("encoding", sinusoidal_table(max_length + offset, d_model, layout),
                             persistent=False)

    def table(self) -> Tensor:
        return self.encoding


class LearnedPositions(_PositionTable):
    """A trained (P + offset, D) table (BERT, GPT-2; BART reserves ``offset`` = 2 leading rows)."""

    def __init__(self, max_length: int, d_model: int, offset: int = 0):
        super().__init__()
        self.max_length, self.offset = max_length, offset
        self.weight = nn.Parameter(torch.empty(max_length + offset, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def table(self) -> Tensor:
        return self.weight
