"""``default_device``: the device named, else the GPU where PyTorch sees one, else the CPU."""

import torch

from aiayn.training.devices import default_device


def test_a_named_device_is_kept():
    assert default_device("cpu") == "cpu"
    assert default_device("cuda:1") == "cuda:1"
    assert default_device(torch.device("cpu")) == "cpu"


def test_no_device_means_the_gpu_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device(None) == "cpu"
