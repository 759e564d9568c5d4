"""Where this checkout's tools and folders are, for tests and measurements: the shared folder, Chromium, and the hold
of the project's CPU-flag reading to AVX2. Not settings of a server: those are engine/config.py's."""
from __future__ import annotations

import os
from pathlib import Path

from .config import PROJECT_DIR

def shared_dir() -> Path:
    """The folder beside the checkout with real images and the full-size skeleton (tests and tools)."""
    return Path(os.environ.get("VLSCOPE_SHARED") or PROJECT_DIR.parent / "shared")


def max_cpu_isa() -> str:
    """VLSCOPE_MAX_CPU_ISA: "avx2" makes this project read the CPU's flags as an AVX2-only CPU's (tests and
    measurements of the AVX2 paths on a bigger CPU, with PyTorch, oneDNN and fbgemm held to AVX2 alike)."""
    return os.environ.get("VLSCOPE_MAX_CPU_ISA", "").lower()


def chromium_binary() -> str:
    """Headless Chromium for the browser checks of tests and the soak (Debian's package by default)."""
    return os.environ.get("VLSCOPE_CHROMIUM") or "/usr/bin/chromium"
