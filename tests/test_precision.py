"""--autocast auto: bf16 exactly where the device runs it natively (CPU flags read from cpuinfo)."""

import pytest
import torch

from aiayn.training.precision import cpu_flags, native_bf16, resolve_autocast

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx2 avx512f {extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu
"""


def write_cpuinfo(tmp_path, extra: str):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.format(extra=extra), encoding="utf-8")
    return path


def test_cpu_flags_reads_the_first_processor(tmp_path):
    assert cpu_flags(write_cpuinfo(tmp_path, "amx_bf16")) == {
        "fpu", "sse2", "avx2", "avx512f", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.mark.parametrize("extra, native", [("amx_bf16 amx_tile", True), ("avx512_bf16", True),
                                           ("avx512bw", False), ("", False)])
def test_native_bf16_on_the_cpu_follows_the_flags(tmp_path, extra, native):
    cpuinfo = write_cpuinfo(tmp_path, extra)
    assert native_bf16("cpu", cpuinfo) is native
    assert resolve_autocast("auto", "cpu", cpuinfo) == ("bf16" if native else None)


def test_resolve_autocast_keeps_explicit_choices(tmp_path):
    cpuinfo = write_cpuinfo(tmp_path, "")
    assert resolve_autocast("bf16", "cpu", cpuinfo) == "bf16"  # asked for: given, native or not
    assert resolve_autocast("fp16", "cpu", cpuinfo) == "fp16"
    assert resolve_autocast("none", "cpu", cpuinfo) is None
    assert resolve_autocast(None, "cpu", cpuinfo) is None
    with pytest.raises(ValueError, match="autocast must be"):
        resolve_autocast("fp8", "cpu", cpuinfo)


def test_no_cuda_device_means_no_native_bf16_there():
    if not torch.cuda.is_available():
        assert native_bf16("cuda") is False
    assert native_bf16("meta") is False
