"""The true ceiling of decode: how fast this process's threads stream memory.

Decode reads every weight once per token, so its rate is bounded by the memory's read rate. A reduction through
PyTorch (a tensor's sum) measured below what llama.cpp reads in the same run, so the figure comes from
memory_read.c: every thread streams its share at the machine's own vector width, best of several tries (on a
shared host the rate moves by a third from one second to the next). Where no kernel builds, PyTorch's sum stands
in, and the figure says less.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from . import native
from ..machine import best_seconds

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def _stream_read():
    """memory_read.c's stream_read, or None where it cannot be built."""
    try:
        function = native.load(SOURCE).stream_read
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("memory read kernel unavailable, PyTorch's sum measures instead: %s", exc)
        return None
    function.restype = ctypes.c_uint64
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return function


def memory_read_gb_per_s(gib: float = 0.5, repeats: int = 10, threads: int | None = None) -> float:
    """GB/s this process reads from a buffer far beyond the caches, on `threads` threads (PyTorch's count by
    default), best of `repeats` after one untimed pass."""
    words = torch.ones(int(gib * (1 << 30)) // 8 // 64 * 64, dtype=torch.int64)
    stream_read, team = _stream_read(), threads or torch.get_num_threads()
    if stream_read is not None:
        def read():
            stream_read(words.data_ptr(), words.numel(), team)
    else:
        def read():
            words.sum()
    return words.numel() * 8 / best_seconds(read, repeats) / 1e9
