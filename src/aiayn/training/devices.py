"""The device a command, task or trainer uses when the caller names none: the GPU where PyTorch
sees one, else the CPU."""

from __future__ import annotations

import torch


def default_device(device: str | torch.device | None = None) -> str:
    """``device`` as given (as a string, checked by ``check_device``), or "cuda" where
    ``torch.cuda.is_available()``, else "cpu"."""
    if device is not None:
        return check_device(str(device))
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(name: str) -> str:
    """``name`` if this PyTorch can use it, else a ValueError saying why (an unknown device type,
    CUDA absent from this build or machine, a GPU index past the last)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r} (e.g. cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this PyTorch ({torch.__version__}) sees no CUDA "
                             f"device (a CPU-only build, or no GPU / driver here)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA "
                             f"devices (cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}: MPS is not available here")
    return name
