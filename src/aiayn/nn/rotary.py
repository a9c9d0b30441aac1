"""Rotary position embeddings (Su et al. 2021, RoFormer, eq. 13-15), the "rotate-half" layout of Llama.

Instead of adding a position vector to the input (paper 3.5), RoPE rotates every query and key by an
angle proportional to its position m, one rotation per pair of dimensions at frequency theta_i:

    theta_i = rope_theta^(-2i / Dh),  i = 0 .. Dh/2 - 1
    rotate(x, m) = x * cos(m theta) + rotate_half(x) * sin(m theta)

so q_m . k_n depends on m and n only through m - n: attention sees relative positions, and a key
rotated once when it enters the KV cache stays right for every later query. Pairs are (i, i + Dh/2)
(GPT-NeoX / Hugging Face Llama's layout), not the paper's adjacent (2i, 2i + 1); the two are a fixed
permutation of q and k's dimensions apart.

Scaled RoPE stretches a model to contexts longer than it was pretrained on by changing the
frequencies (``config.rope_scaling``, the keys of Hugging Face's ``rope_parameters``):

- "linear" (Chen et al. 2023, position interpolation): every theta_i / factor;
- "llama3" (Llama 3.1): wavelengths 2 pi / theta_i longer than original_max_position_embeddings /
  low_freq_factor are divided by factor, those shorter than ... / high_freq_factor are kept, and the
  band between is interpolated smoothly;
- "yarn" (Peng et al. 2023): low frequencies interpolated, high ones kept, a linear ramp between
  (beta_fast / beta_slow rotations), and cos and sin multiplied by an attention factor
  (0.1 ln(factor) + 1 unless given).

Legend: B batch, H heads, T length, Dh head width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

Rotation = tuple[Tensor, Tensor]  # (cos, sin), each (T, Dh) or (B, 1, T, Dh)

# rope_scaling["rope_type"] -> (required keys, optional keys)
ROPE_SCALINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
}
# Hugging Face's rope_type values that aiayn leaves out, and why
UNSUPPORTED_ROPE_SCALINGS = {
    "dynamic": "its frequencies change with the length of the input, so keys already in a KV "
               "cache were rotated by other angles",
    "longrope": "Phi-3's per-frequency factors are not implemented",
}


def check_rope_scaling(scaling: Any) -> None:
    """A clear ValueError for anything ``rotary_frequencies`` cannot use."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a dict with a 'rope_type' or None, got {scaling!r}")
    kind = scaling.get("rope_type")
    if kind in UNSUPPORTED_ROPE_SCALINGS:
        raise ValueError(f"rope_scaling rope_type={kind!r} is not supported: "
                         f"{UNSUPPORTED_ROPE_SCALINGS[kind]}")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling rope_type must be one of {sorted(ROPE_SCALINGS)}, got "
                         f"{kind!r}")
    required, optional = ROPE_SCALINGS[kind]
    missing = [key for key in required if scaling.get(key) is None]
    unknown = sorted(set(scaling) - {"rope_type", *required, *optional})
    if missing or unknown:
        raise ValueError(f"rope_scaling of rope_type={kind!r} needs {list(required)}"
                         + (f" and may have {list(optional)}" if optional else "")
                         + f"; missing {missing}, unknown {unknown}")
    for key, value in scaling.items():
        if key in ("rope_type", "truncate") or (value is None and key in optional):
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"rope_scaling {key} must be a positive number, got {value!r}")
    if scaling["factor"] < 1:
        raise ValueError(f"rope_scaling factor stretches the context and must be >= 1, got "
                         f"{scaling['factor']!r}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor ({scaling['high_freq_factor']}) must "
                         f"exceed low_freq_factor ({scaling['low_freq_factor']})")


def rotary_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None = None
                       ) -> tuple[Tensor, float]:
    """The inverse frequencies theta_i (Dh/2,) in float32 and the factor on cos and sin (1 except
    for YaRN), computed in float32 as Hugging Face computes them, so the angles agree bit for bit.
    """
    check_rope_scaling(scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim  # (Dh/2,)
    inverse = 1.0 / (theta ** exponents)
    if scaling is None:
        return inverse, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":  # position interpolation: m / factor, the same as theta_i / factor
        return inverse / factor, 1.0
    if kind == "llama3":
        original = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inverse  # (Dh/2,)
        scaled = torch.where(wavelength > original / low, inverse / factor, inverse)
        smooth = (original / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        between = ~(wavelength < original / high) & ~(wavelength > original / low)
        return torch.where(between, smoothed, scaled), 1.0
    return _yarn(inverse, head_dim, theta, scaling)


def _yarn(inverse: Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
          ) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate the frequencies that turn fewer than beta_slow times
    over the original context, keep those that turn more than beta_fast times, ramp between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the pair index i that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep theta_i), 0: interpolate (theta_i / factor)
    inverse = inverse / factor * (1 - keep) + inverse * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inverse, float(attention)


class RotaryEmbedding(nn.Module):
    """The cosines and sines of positions, computed on the fly from the frequencies (a buffer).

    Args:
        head_dim: Dh, even.
        theta: the base of the frequencies (``config.rope_theta``; 10000 in the paper and Llama 2).
        max_length: positions at or beyond it are an error (``config.max_length``).
        scaling: scaled RoPE (``config.rope_scaling``; see the module docstring), or None.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, max_length: int = 1024,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head width, got {head_dim}")
        self.max_length = max_length
        inverse, self.attention_factor = rotary_frequencies(head_dim, theta, scaling)
        self.register_buffer("inverse_frequency", inverse, persistent=False)  # (Dh/2,)

    def forward(self, positions: Tensor) -> Rotation:
        """(cos, sin) for positions (T,) -> each (T, Dh), or (B, T) -> each (B, 1, T, Dh): shapes
        that broadcast over the heads of (B, H, T, Dh) queries and keys."""
        angles = positions[..., None].float() * self.inverse_frequency  # (..., T, Dh/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., T, Dh): pair i with i + Dh/2
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN: sharper attention at the stretched length
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
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
