"""benchmarks/gemm_libraries.py measures what it says: its OpenBLAS product computes the same
bias + x @ W.T as PyTorch's, and its OpenBLAS forward patch changes only where the products run (the
same outputs, the plain ``nn.Linear`` back afterwards). No timing assertions."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gemm_libraries  # noqa: E402


@pytest.mark.parametrize("shape", [(96, 32, 48), (128, 64, 16)])
def test_openblas_product_equals_pytorchs(shape):
    results = {}
    for library in ("mkl", "openblas"):
        torch.manual_seed(0)  # the same inputs for both
        results[library] = torch.as_tensor(gemm_libraries.product(library, *shape)())
    assert results["openblas"].shape == (shape[0], shape[2])
    torch.testing.assert_close(results["openblas"], results["mkl"], rtol=1e-5, atol=1e-5)


def test_openblas_forward_patch_keeps_outputs_and_restores_linear():
    torch.manual_seed(0)
    layer = nn.Linear(32, 24)
    many, few = torch.randn(2, 80, 32), torch.randn(4, 32)  # 160 rows: OpenBLAS; 4: the plain path
    plain = nn.Linear.forward
    with torch.inference_mode():
        expected_many, expected_few = layer(many), layer(few)
        with gemm_libraries.openblas_products():
            assert nn.Linear.forward is not plain
            got_many, got_few = layer(many), layer(few)
    assert nn.Linear.forward is plain
    torch.testing.assert_close(got_many, expected_many, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_few, expected_few)
    with pytest.raises(RuntimeError, match="inside"):
        with gemm_libraries.openblas_products():
            raise RuntimeError("inside")
    assert nn.Linear.forward is plain  # restored after an error too
