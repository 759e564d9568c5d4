"""This project's C kernels, built once per machine with the system's C compiler and loaded through ctypes.

A kernel is compiled with OpenMP into the user's cache folder, for this CPU, or for AVX2 under
VLSCOPE_MAX_CPU_ISA=avx2, keyed by its source, the compiler and the CPU's flags. Each caller checks a kernel's
results against PyTorch before using it, and says why not where it cannot build.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..machine import cpu_flags, held_to_avx2


def compiler() -> str | None:
    """The C compiler kernels are built with: $CC, else cc or gcc on the path; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_folder() -> Path:
    """Where built kernels are kept: the user's cache folder, else (not writable) a folder of this user's own in the
    temporary folder. Only a folder this user owns and nobody else can write to: a library found there is loaded."""
    for folder in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlscope" / "kernels",
                   Path(tempfile.gettempdir()) / f"vlscope-kernels-{os.getuid()}"):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            status = folder.stat()
            if status.st_uid == os.getuid() and not status.st_mode & 0o022 and os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise RuntimeError("no cache folder of this user's own to build the kernel in")


def isa_flags() -> list[str]:
    return ["-mavx2", "-mfma", "-mf16c"] if held_to_avx2() else ["-march=native"]


def build(source: Path, compiler: str, folder: Path) -> Path:
    """The shared library for `source`, `compiler` and this instruction set, built unless already there."""
    flags = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", *isa_flags()]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    # The CPU's flags too: a home folder shared by machines of other kinds must not hand one another's build over.
    parts = [source.read_text(), version, *flags, *sorted(cpu_flags())]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    library = folder / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=folder) as work:
        objects, built = Path(work) / "kernel.o", Path(work) / "kernel.so"
        # Linked without -ffast-math: GCC would add crtfastmath, which flushes denormals for the whole process.
        for command in ([compiler, *flags, "-c", str(source), "-o", str(objects)],
                        [compiler, "-shared", "-fopenmp", str(objects), "-o", str(built), "-lm"]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError((result.stderr.strip().splitlines() or ["no output"])[-1][:200])
        os.replace(built, library)  # whole or not at all, if two processes build at once
    return library


def load(source: Path, compiler_path: str | None = None) -> ctypes.CDLL:
    """`source` built (or found built) and loaded. Raises RuntimeError, OSError or SubprocessError where it cannot be."""
    chosen = compiler_path or compiler()
    if not chosen:
        raise RuntimeError("no C compiler")
    return ctypes.CDLL(str(build(source, chosen, cache_folder())))
