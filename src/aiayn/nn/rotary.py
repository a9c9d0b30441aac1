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
  (0.1 ln(factor) + 1 unless given);
- "longrope" (Ding et al. 2024, LongRoPE; Phi-3's long-context models): theta_i / short_factor[i]
  while a call's furthest position lies inside original_max_position_embeddings, theta_i /
  long_factor[i] once it lies beyond, and cos and sin multiplied by sqrt(1 + ln(factor) /
  ln(original_max_position_embeddings)) unless attention_factor is given. The choice is made per
  call, from that call's positions, as transformers makes it: keys already in a KV cache keep the
  angles they were written with (``aiayn.decoding.generation.generate`` runs the sequence again
  when it first grows past the original context, as transformers' Phi-3 ``generate`` does).

Partial rotary positions (``config.rotary_fraction``, Hugging Face's ``partial_rotary_factor``;
Phi-4-mini: 0.75) rotate only the first Dr = int(Dh * fraction) dimensions of each head, with
the frequencies of a Dr-wide head (theta_i = rope_theta^(-2i / Dr), i < Dr/2); the other Dh - Dr
pass through unchanged.

Legend: B batch, H heads, T length, Dh head width, Dr rotated width (Dh unless partial).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

Rotation = tuple[Tensor, Tensor]  # (cos, sin), each (T, Dr) or (B, 1, T, Dr)

# rope_scaling["rope_type"] -> (required keys, optional keys)
ROPE_SCALINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
    "longrope": (("factor", "short_factor", "long_factor", "original_max_position_embeddings"),
                 ("attention_factor",)),
}
LONGROPE_FACTORS = ("short_factor", "long_factor")  # one divisor per frequency: lists of Dr/2
# Hugging Face's rope_type values that aiayn leaves out, and why
UNSUPPORTED_ROPE_SCALINGS = {
    "dynamic": "its frequencies change with the length of the input, so keys already in a KV "
               "cache were rotated by other angles",
}


def check_rope_scaling(scaling: Any, dim: int | None = None) -> None:
    """A clear ValueError for anything ``rotary_frequencies`` cannot use; ``dim``: the rotated
    width Dr, which LongRoPE's factor lists must match (Dr/2 entries each)."""
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
        if key in LONGROPE_FACTORS:
            _check_factors(key, value, dim)
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"rope_scaling {key} must be a positive number, got {value!r}")
    if scaling["factor"] < 1 and kind != "longrope":  # LongRoPE's only sets the attention factor
        raise ValueError(f"rope_scaling factor stretches the context and must be >= 1, got "
                         f"{scaling['factor']!r}")
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor ({scaling['high_freq_factor']}) must "
                         f"exceed low_freq_factor ({scaling['low_freq_factor']})")


def _check_factors(key: str, value: Any, dim: int | None) -> None:
    if not isinstance(value, list) or not value or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
        raise ValueError(f"rope_scaling {key} must be a list of positive numbers, one per "
                         f"rotary frequency, got {value!r}")
    if dim is not None and len(value) != dim // 2:
        raise ValueError(f"rope_scaling {key} needs one entry per rotary frequency: {dim // 2} "
                         f"for a rotated width of {dim}, got {len(value)}")


def longrope_switch(scaling: dict[str, Any] | None) -> int | None:
    """The position from which LongRoPE takes its long factors (original_max_position_embeddings),
    or None for any other scaling: a sequence that grows to it turns every angle."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def rotary_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None = None, *,
                       long: bool = False) -> tuple[Tensor, float]:
    """The inverse frequencies theta_i (Dr/2,) of a rotated width ``dim`` = Dr in float32 and the
    factor on cos and sin (1 except for YaRN and LongRoPE), computed in float32 as Hugging Face
    computes them, so the angles agree bit for bit. ``long``: LongRoPE's long factors (else its
    short ones)."""
    check_rope_scaling(scaling, dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim  # (Dr/2,)
    if scaling is not None and scaling["rope_type"] == "longrope":
        return _longrope(exponents, theta, scaling, long)
    inverse = 1.0 / (theta ** exponents)
    if scaling is None:
        return inverse, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":  # position interpolation: m / factor, the same as theta_i / factor
        return inverse / factor, 1.0
    if kind == "llama3":
        original = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inverse  # (Dr/2,)
        scaled = torch.where(wavelength > original / low, inverse / factor, inverse)
        smooth = (original / wavelength - low) / (high - low)  # 0 at the long end, 1 at the short
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        between = ~(wavelength < original / high) & ~(wavelength > original / low)
        return torch.where(between, smoothed, scaled), 1.0
    return _yarn(inverse, dim, theta, scaling)


def _longrope(exponents: Tensor, theta: float, scaling: dict[str, Any], long: bool
              ) -> tuple[Tensor, float]:
    """LongRoPE (Ding et al. 2024): theta_i divided by a searched factor of its own, one list for
    contexts within the original length, one beyond; cos and sin scaled up as the context grows."""
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"],
                           dtype=torch.float32)  # (Dr/2,)
    inverse = 1.0 / (factors * theta ** exponents)  # transformers' order of operations
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inverse, float(attention)


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
        dim: Dr, the rotated width of a head: Dh, or its first int(Dh * fraction) dimensions
            (``config.rotary_dim``); even.
        theta: the base of the frequencies (``config.rope_theta``; 10000 in the paper and Llama 2).
        max_length: positions at or beyond it are an error (``config.max_length``).
        scaling: scaled RoPE (``config.rope_scaling``; see the module docstring), or None.
    """

    def __init__(self, dim: int, theta: float = 10000.0, max_length: int = 1024,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary positions need an even rotated width, got {dim}")
        self.max_length = max_length
        inverse, self.attention_factor = rotary_frequencies(dim, theta, scaling)
        self.register_buffer("inverse_frequency", inverse, persistent=False)  # (Dr/2,)
        self.switch = longrope_switch(scaling)  # LongRoPE: where the long factors take over
        long = rotary_frequencies(dim, theta, scaling, long=True)[0] if self.switch else None
        self.register_buffer("long_inverse_frequency", long, persistent=False)  # (Dr/2,) or None

    def forward(self, positions: Tensor) -> Rotation:
        """(cos, sin) for positions (T,) -> each (T, Dr), or (B, T) -> each (B, 1, T, Dr): shapes
        that broadcast over the heads of (B, H, T, Dh) queries and keys."""
        inverse = self.inverse_frequency  # (Dr/2,)
        if self.long_inverse_frequency is not None:
            # LongRoPE: the long factors when this call's furthest position lies past the original
            # context (transformers' rule: max position + 1 > original), chosen on the device.
            beyond = positions.max() >= self.switch  # () bool
            inverse = torch.where(beyond, self.long_inverse_frequency, inverse)
        angles = positions[..., None].float() * inverse  # (..., T, Dr/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., T, Dr): pair i with i + Dr/2
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:  # YaRN, LongRoPE: sharper attention when stretched
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, Dr)
        return cos, sin

    def extra_repr(self) -> str:
        return f"dim={2 * self.inverse_frequency.numel()}, max_length={self.max_length}"


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: a quarter turn of every pair."""
    first, second = x.chunk(2, dim=-1)  # 2 x (..., Dh/2)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: Tensor, rotation: Rotation) -> Tensor:
    """Queries or keys (B, H, T, Dh) rotated by their positions' angles: all Dh dimensions, or,
    with partial rotary positions (cos and sin Dr < Dh wide), the first Dr, the rest unchanged."""
    cos, sin = rotation[0].to(x.dtype), rotation[1].to(x.dtype)  # (..., T, Dr)
    width = cos.shape[-1]  # Dr
    if width == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    turned, passed = x[..., :width], x[..., width:]  # (B, H, T, Dr), (B, H, T, Dh - Dr)
    return torch.cat(((turned * cos) + (rotate_half(turned) * sin), passed), dim=-1)
