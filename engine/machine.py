"""What this machine is, as far as CPU inference cares: CPU, ISA flags, huge pages, threads, memory, versions."""
from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

# Flags as /proc/cpuinfo spells them, with what each means for this workload.
ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI (int8 dot products)",
    "avx_vnni": "AVX-VNNI (int8 dot products)",
    "avx512_bf16": "AVX-512 BF16",
    "amx_tile": "AMX tiles",
    "amx_bf16": "AMX BF16",
    "amx_int8": "AMX INT8",
}


# The vector ISA levels that pick different kernels here, highest first, each with the flags that make it: a
# benchmark holds for CPUs of one level, whatever other flags they carry.
CPU_KINDS = (
    ("amx", "Intel AMX", {"amx_tile", "amx_bf16"}),
    ("avx512-bf16", "AVX-512 BF16/VNNI", {"avx512_bf16", "avx512_vnni"}),
    ("avx512", "AVX-512", {"avx512f"}),
    ("avx2", "AVX2", {"avx2"}),
)


def cpu_kind(isa_flags) -> str:
    """The highest ISA level whose flags are all present ("other" below AVX2): "amx", "avx512-bf16", "avx512",
    "avx2"."""
    flags = set(isa_flags)
    return next((kind for kind, _, needs in CPU_KINDS if needs <= flags), "other")


def cpu_kind_name(kind: str) -> str:
    return next((name for known, name, _ in CPU_KINDS if known == kind), "below AVX2")


@dataclass(frozen=True)
class SystemReport:
    cpu_model: str
    physical_cores: int
    logical_cores: int
    isa_flags: tuple[str, ...]  # keys of ISA_FLAGS present
    transparent_hugepages: str
    torch_threads: int
    torch_version: str
    transformers_version: str
    memory_total_bytes: int
    memory_available_bytes: int

    @property
    def cpu_kind(self) -> str:
        return cpu_kind(self.isa_flags)

    @property
    def advice(self) -> list[str]:
        return advice_for(self)


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model in ("", platform.machine(), platform.processor()):
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
                if held_to_avx2():
                    flags = {flag for flag in flags if not flag.startswith(_ABOVE_AVX2)}
    except OSError:
        pass
    return model, flags


# Flags above AVX2 that change which kernels this project picks; VLSCOPE_MAX_CPU_ISA=avx2 hides them.
_ABOVE_AVX2 = ("avx512", "avx_vnni", "avx_ne_convert", "amx")

# Holds PyTorch, oneDNN, fbgemm and this project's own flag reading to AVX2 on a bigger CPU, so that one machine
# also runs the paths an AVX2-only server takes. Set before torch is imported: a child process's environment.
AVX2_DISPATCH = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
                 "VLSCOPE_MAX_CPU_ISA": "avx2"}


def held_to_avx2() -> bool:
    """VLSCOPE_MAX_CPU_ISA=avx2: this project reads the CPU's flags as an AVX2-only CPU's, as the libraries do."""
    return os.environ.get("VLSCOPE_MAX_CPU_ISA", "").lower() == "avx2"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo spells them (empty where there is no such file), without those
    above AVX2 when VLSCOPE_MAX_CPU_ISA=avx2."""
    return frozenset(_cpuinfo()[1])


def _thp_setting() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"
    # The kernel marks the active choice in brackets: "always [madvise] never".
    for word in text.split():
        if word.startswith("["):
            return word.strip("[]")
    return text


def system_report() -> SystemReport:
    import transformers

    model, flags = _cpuinfo()
    memory = psutil.virtual_memory()
    return SystemReport(
        cpu_model=model,
        physical_cores=psutil.cpu_count(logical=False) or 1,
        logical_cores=psutil.cpu_count(logical=True) or 1,
        isa_flags=tuple(flag for flag in ISA_FLAGS if flag in flags),
        transparent_hugepages=_thp_setting(),
        torch_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        memory_total_bytes=memory.total,
        memory_available_bytes=memory.available,
    )


def advice_for(report: SystemReport) -> list[str]:
    """What follows from the facts. Advice only: the bench measures, and its numbers win over these rules."""
    flags = set(report.isa_flags)
    tips = []
    if {"amx_bf16", "avx512_bf16"} & flags:
        tips.append("This CPU computes bfloat16 natively (AMX or AVX-512 BF16): bfloat16 usually beats float32 "
                    "here on prefill and decode. Measure with the benchmark before switching.")
    else:
        tips.append("No native bfloat16 on this CPU: float32 is usually the faster choice; bfloat16 is emulated.")
    if "avx512_vnni" in flags or "amx_int8" in flags:
        tips.append("int8 instructions are present: int8 weights halve the bytes read per token versus bfloat16, "
                    "which is what bounds decode speed. Check the accuracy drift in the benchmark.")
    if report.transparent_hugepages == "always":
        tips.append("Transparent huge pages are 'always': the first request after load may stall while the kernel "
                    "compacts memory; 'madvise' or 'never' gives a steadier first request.")
    if report.torch_threads > report.physical_cores:
        tips.append(f"torch uses {report.torch_threads} threads on {report.physical_cores} physical cores: "
                    "hyper-threads rarely help matrix work; try threads = physical cores.")
    weights_fp32 = 2.4e9 * 4
    if report.memory_total_bytes < weights_fp32 * 1.3:
        tips.append("Memory is tight for float32 weights (~9.8 GB): prefer bfloat16 or int8.")
    return tips


# Shapes of Qwen3-VL-2B's language model: an MLP projection, a prefill-sized block of rows and one decode token.
# Kept small enough to finish in seconds where bfloat16 is emulated.
HIDDEN, INTERMEDIATE, PREFILL_ROWS = 2048, 6144, 128


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


@functools.cache
def bfloat16_matmul_is_faster(threads: int) -> bool:
    """A prefill-sized product in each dtype, timed now (well under a second even where bfloat16 is emulated).
    Cached per thread count: the answer is a property of the CPU, asked at every model load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows, weight = torch.randn(PREFILL_ROWS, HIDDEN), torch.randn(HIDDEN, HIDDEN)  # nn.Linear's layout
        with torch.inference_mode():
            fp32 = best_seconds(lambda: torch.nn.functional.linear(rows, weight), 3)
            rows, weight = rows.bfloat16(), weight.bfloat16()
            bf16 = best_seconds(lambda: torch.nn.functional.linear(rows, weight), 3)
    finally:
        torch.set_num_threads(previous)
    return bf16 < fp32
