"""Whether a device runs bfloat16 products natively, so that bf16 autocast pays off there.

On a CPU that is the ``amx_bf16`` (Intel AMX) or ``avx512_bf16`` instruction set: there a bf16
matrix product runs several times faster than float32 (and a MiniLM fine-tuning step 2.2x,
benchmarks/minilm_step.py); elsewhere PyTorch emulates bf16 and autocast only adds casts. The CPU's
flags are read from /proc/cpuinfo (Linux); other systems answer False.
"""

from __future__ import annotations

from pathlib import Path

import torch

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of the first CPU listed in ``cpuinfo`` (empty if unreadable)."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def native_bf16(device: str | torch.device, cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True where bf16 autocast runs natively: a CUDA device that supports bf16, or a CPU with
    AMX-BF16 / AVX512-BF16 instructions."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(flag in cpu_flags(cpuinfo) for flag in CPU_BF16_FLAGS)
    return False


def resolve_autocast(value: str | None, device: str | torch.device,
                     cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """A command line's --autocast as ``TrainingConfig.autocast``: "none" / None -> None (float32),
    "auto" -> "bf16" where ``native_bf16(device)`` else None, "bf16" / "fp16" as given."""
    if value in (None, "none"):
        return None
    if value == "auto":
        return "bf16" if native_bf16(device, cpuinfo) else None
    if value in ("bf16", "fp16"):
        return value
    raise ValueError(f"autocast must be 'bf16', 'fp16', 'auto' or 'none', got {value!r}")
