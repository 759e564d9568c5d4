"""The decode attention kernel against PyTorch's matmuls, and what happens where it cannot be built."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.kernels.decode_attention import KernelAttention, MatmulAttention, best, choose
from engine.kernels.native import cache_folder
from engine.kernels.decode_attention import SequenceKV

from .conftest import ROOT

pytestmark = pytest.mark.kernels

LENGTHS = (1, 37, 300)  # a sequence's first answer token, a short one, one past a growth step's worth


def _sequences(dtype: torch.dtype, kv_heads: int, dim: int, generator) -> list[SequenceKV]:
    return [SequenceKV([torch.randn(kv_heads, length + 9, dim, generator=generator).to(dtype) for _ in range(2)],
                       [torch.randn(kv_heads, length + 9, dim, generator=generator).to(dtype) for _ in range(2)],
                       length) for length in LENGTHS]


def _copies(kvs: list[SequenceKV]) -> list[SequenceKV]:
    return [SequenceKV([k.clone() for k in kv.keys], [v.clone() for v in kv.values], kv.length) for kv in kvs]


def _kernel() -> KernelAttention:
    attention, note = best()
    assert isinstance(attention, KernelAttention), note  # gcc is installed wherever this suite runs
    return attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [2, 3])
def test_the_kernel_attends_as_the_matmuls_do_and_writes_the_new_token(dtype, groups):
    """Three sequences of different lengths in one call, on both layers: each row's output is the matmuls' over its
    own length (float32 arithmetic either way), and the new key and value land in each buffer as PyTorch would
    round them into it."""
    generator = torch.Generator().manual_seed(1)
    kv_heads, dim = 4, 64
    kvs = _sequences(dtype, kv_heads, dim, generator)
    expected = _copies(kvs)
    attend = _kernel().step(kvs, kv_heads, groups, dim, dim ** -0.5)
    reference = MatmulAttention().step(expected, kv_heads, groups, dim, dim ** -0.5)
    with torch.inference_mode():
        for layer in range(2):
            query = torch.randn(len(kvs), kv_heads * groups, dim, generator=generator)
            key, value = (torch.randn(len(kvs), kv_heads, dim, generator=generator) for _ in range(2))
            got, want = attend(layer, query, key, value), reference(layer, query, key, value)
            assert got.shape == (len(kvs), kv_heads, groups, dim)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for mine, theirs in zip(kvs, expected):
        for a, b in zip(mine.keys + mine.values, theirs.keys + theirs.values):
            assert torch.equal(a, b)


def test_a_sequence_attends_the_same_alone_as_in_a_batch():
    """Each (sequence, head) is one thread's work in one order: a row's result is bit-identical whatever shares the
    call, which keeps float32 answers in a batch the same as alone."""
    generator = torch.Generator().manual_seed(2)
    kvs = _sequences(torch.float32, 8, 128, generator)
    query = torch.randn(len(kvs), 16, 128, generator=generator)
    key, value = (torch.randn(len(kvs), 8, 128, generator=generator) for _ in range(2))
    kernel = _kernel()
    with torch.inference_mode():
        together = kernel.step(_copies(kvs), 8, 2, 128, 128 ** -0.5)(0, query, key, value)
        for row, kv in enumerate(kvs):
            alone = kernel.step(_copies([kv]), 8, 2, 128, 128 ** -0.5)(0, query[row:row + 1], key[row:row + 1],
                                                                       value[row:row + 1])
            assert alone.shape == (8, 2, 128)  # one sequence: the compiled one-row segments' shape
            assert torch.equal(alone, together[row])


def test_the_cached_form_matches_the_step_form_to_the_bit():
    """transformers' forward attends through `cached` over its own cache: the same arithmetic as the direct step's."""
    generator = torch.Generator().manual_seed(3)
    kvs = _sequences(torch.bfloat16, 8, 128, generator)[1:2]
    query = torch.randn(1, 16, 128, generator=generator)
    key, value = (torch.randn(1, 8, 128, generator=generator) for _ in range(2))
    kernel = _kernel()
    with torch.inference_mode():
        step_form = kernel.step(kvs, 8, 2, 128, 128 ** -0.5)(0, query, key, value)
        length = kvs[0].length + 1
        cached = kernel.cached(query.view(8, 2, 128), kvs[0].keys[0][:, :length].contiguous(),
                               kvs[0].values[0][:, :length].contiguous(), 128 ** -0.5)
    assert torch.equal(step_form, cached)


def test_the_kernel_shares_pytorchs_openmp_runtime():
    """Its threads are PyTorch's team: a second OpenMP runtime would keep two teams spinning on two cores. In a
    fresh process, loading it maps no libgomp beyond those already there (PyTorch's, and any a wheel bundles under
    a name of its own)."""
    script = (
        "import torch\n"
        "from pathlib import Path\n"
        "from engine.kernels.decode_attention import KernelAttention, best\n"
        "def mapped():\n"
        "    return {line.split()[-1] for line in Path('/proc/self/maps').read_text().splitlines()\n"
        "            if 'libgomp' in line.split()[-1]}\n"
        "before = mapped()\n"
        "assert isinstance(best()[0], KernelAttention), best()[1]\n"
        "print(sorted(before), sorted(mapped() - before))\n"
        "assert mapped() == before and any(Path(p).parent.name == 'lib' and 'torch' in p for p in before)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_without_a_working_compiler_decode_attends_on_the_matmuls(tmp_path):
    attention, note = choose(None)
    assert isinstance(attention, MatmulAttention) and "no C compiler" in note
    attention, note = choose("/bin/false")
    assert isinstance(attention, MatmulAttention) and "building vlscope's kernel failed" in note
    # and the fallback still attends: one sequence, through the same step contract
    generator = torch.Generator().manual_seed(4)
    kvs = _sequences(torch.float32, 2, 32, generator)[:1]
    with torch.inference_mode():
        out = attention.step(kvs, 2, 2, 32, 32 ** -0.5)(0, torch.randn(1, 4, 32), torch.randn(1, 2, 32),
                                                        torch.randn(1, 2, 32))
    assert out.shape == (2, 2, 32) and torch.isfinite(out).all()


def test_kernels_are_only_kept_where_nobody_else_can_write(tmp_path, monkeypatch):
    """A library found in the cache folder is loaded: a folder others can write to is never used for it."""
    shared = tmp_path / "shared-cache"
    (shared / "vlscope" / "kernels").mkdir(parents=True)
    (shared / "vlscope" / "kernels").chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    folder = cache_folder()
    assert folder != shared / "vlscope" / "kernels"
    assert folder.stat().st_mode & 0o777 == 0o700
    (shared / "vlscope" / "kernels").chmod(0o700)
    assert cache_folder() == shared / "vlscope" / "kernels"
