"""The kernel tests once more, under AVX2-only dispatch, so that a green run on a bigger CPU is green on an AVX2 one.

PyTorch (ATEN_CPU_CAPABILITY), oneDNN (ONEDNN_MAX_CPU_ISA), fbgemm (FBGEMM_ENABLE_INSTRUCTIONS) and this project's
own reading of the CPU flags (VLSCOPE_MAX_CPU_ISA) are each held to AVX2 in a child pytest: they are read when torch
loads, so this process cannot switch them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.kernels.packing import packing_works
from engine.kernels.quantize import has_int8_dot_product
from engine.machine import AVX2_DISPATCH, _ABOVE_AVX2, cpu_flags, held_to_avx2

from .conftest import ROOT


@pytest.mark.kernels
def test_dispatch_matches_the_flags_this_project_reads():
    """Under VLSCOPE_MAX_CPU_ISA=avx2 the kernels really are AVX2's: the project's flag reading, PyTorch's dispatch
    and oneDNN's bfloat16 packing agree."""
    if not held_to_avx2():
        if not any(flag.startswith(_ABOVE_AVX2) for flag in cpu_flags()):
            assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")
        return
    assert not any(flag.startswith(_ABOVE_AVX2) for flag in cpu_flags())
    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not has_int8_dot_product()
    assert not packing_works(torch.bfloat16)  # oneDNN needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT for it
    assert packing_works(torch.float32)


def test_kernel_tests_pass_under_avx2_dispatch(tmp_path):
    if held_to_avx2():
        pytest.skip("this run is already held to AVX2")
    above = sorted(flag for flag in cpu_flags() if flag.startswith(_ABOVE_AVX2))
    if not above:
        pytest.skip("this CPU has no ISA above AVX2 (no AVX-512, VNNI or AMX): the main run is the AVX2 run")
    env = {**os.environ, **AVX2_DISPATCH, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "kernels", "-p", "no:cacheprovider", "--basetemp",
         str(tmp_path / "avx2"), "tests/test_model.py", "tests/test_kernels_products.py", "tests/test_direct_step.py",
         "tests/test_decode_attention.py", "tests/test_int4.py", "tests/test_isa.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(result.stdout.splitlines()[-40:])
    assert result.returncode == 0, f"kernel tests under AVX2 dispatch (hiding {', '.join(above)}):\n{tail}"
    assert " passed" in tail and " failed" not in tail, tail
