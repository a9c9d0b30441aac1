"""PyTorch's intra-op thread count set for a block: the split products depend on it."""
import contextlib

import torch


@contextlib.contextmanager
def threads(count: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
