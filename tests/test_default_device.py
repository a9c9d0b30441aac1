"""``default_device``: the device named, else the GPU where PyTorch sees one, else the CPU."""

import pytest
import torch

from aiayn.training.devices import default_device


def test_a_named_device_is_kept(monkeypatch):
    assert default_device("cpu") == "cpu"
    assert default_device(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_device("cuda:1") == "cuda:1"


def test_a_device_this_torch_cannot_use_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        default_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        default_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"there are 2 CUDA devices \(cuda:0 .. cuda:1\)"):
        default_device("cuda:2")


def test_no_device_means_the_gpu_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(None) == "cpu"
