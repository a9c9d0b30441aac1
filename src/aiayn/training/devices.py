"""The device a command, task or trainer uses when the caller names none: the GPU where PyTorch
sees one, else the CPU."""

from __future__ import annotations

import torch


def default_device(device: str | torch.device | None = None) -> str:
    """``device`` as given (as a string), or "cuda" where ``torch.cuda.is_available()``, else "cpu"."""
    if device is not None:
        return str(device)
    return "cuda" if torch.cuda.is_available() else "cpu"
