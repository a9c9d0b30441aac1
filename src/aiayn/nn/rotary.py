"""Rotary position embeddings (Su et al. 2021, RoFormer, eq. 13-15), the "rotate-half" layout of Llama.

Instead of adding a position vector to the input (paper 3.5), RoPE rotates every query and key by an
angle proportional to its position m, one rotation per pair of dimensions at frequency theta_i:

    theta_i = rope_theta^(-2i / Dh),  i = 0 .. Dh/2 - 1
    rotate(x, m) = x * cos(m theta) + rotate_half(x) * sin(m theta)

so q_m . k_n depends on m and n only through m - n: attention sees relative positions, and a key
rotated once when it enters the KV cache stays right for every later query. Pairs are (i, i + Dh/2)
(GPT-NeoX / Hugging Face Llama's layout), not the paper's adjacent (2i, 2i + 1); the two are a fixed
permutation of q and k's dimensions apart.

Legend: B batch, H heads, T length, Dh head width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

Rotation = tuple[Tensor, Tensor]  # (cos, sin), each (T, Dh) or (B, 1, T, Dh)


class RotaryEmbedding(nn.Module):
    """The cosines and sines of positions, computed on the fly from the frequencies (a buffer).

    Args:
        head_dim: Dh, even.
        theta: the base of the frequencies (``config.rope_theta``; 10000 in the paper and Llama 2).
        max_length: positions at or beyond it are an error (``config.max_length``).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, max_length: int = 1024):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head width, got {head_dim}")
        self.max_length = max_length
        # float32 from float32 exponents, as Hugging Face computes them: the same angles bit for bit
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim  # (Dh/2,)
        self.register_buffer("inverse_frequency", 1.0 / (theta ** exponents), persistent=False)

    def forward(self, positions: Tensor) -> Rotation:
        """(cos, sin) for positions (T,) -> each (T, Dh), or (B, T) -> each (B, 1, T, Dh): shapes
        that broadcast over the heads of (B, H, T, Dh) queries and keys."""
        angles = positions[..., None].float() * self.inverse_frequency  # (..., T, Dh/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., T, Dh): pair i with i + Dh/2
        cos, sin = angles.cos(), angles.sin()
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, Dh)
        return cos, sin

    def extra_repr(self) -> str:
        return f"head_dim={2 * self.inverse_frequency.numel()}, max_length={self.max_length}"


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: a quarter turn of every pair."""
    first, second = x.chunk(2, dim=-1)  # 2 x (..., Dh/2)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: Tensor, rotation: Rotation) -> Tensor:
    """Queries or keys (B, H, T, Dh) rotated by their positions' angles."""
    cos, sin = rotation
    return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))
