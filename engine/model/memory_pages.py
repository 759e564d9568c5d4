"""Where the loaded weights sit in the process's memory: freed load-time copies handed back to the operating system,
and the weights moved onto huge pages, which decode streams through once a token."""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time

from ..records.metrics import proc_bytes


def release_freed_memory() -> None:
    """Hand the memory that load-time conversions freed (plain weights replaced by packed or int8 ones) back to the
    operating system. glibc keeps freed blocks of that size in its heap, where RSS goes on counting them: on the
    full-size model that was gigabytes held for nothing (docs/decisions.md)."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to do
        pass


MADV_COLLAPSE = 25  # Linux 6.1+: back a range with huge pages now (khugepaged would take minutes, if ever)
HUGE_PAGE = 2 << 20
# Weights below this are moved onto huge pages for nothing: the move costs seconds over the whole process's memory
# whatever the model's size, and a token that reads a few megabytes of weights gains too little to see.
HUGE_PAGES_FROM_WEIGHT_BYTES = 256 << 20
# Where the kernel must compact memory to find free huge pages the move can take far longer than elsewhere
# (docs/decisions.md, "Huge pages after load"): load stops it after this long. Regions go largest first, in pieces,
# so the weights move first.
HUGE_PAGES_BUDGET_S = 8.0
COLLAPSE_PIECE = 64 << 20


def huge_page_bytes() -> int:
    """This process's anonymous memory backed by huge pages (0 where the kernel does not say)."""
    return proc_bytes("/proc/self/smaps_rollup", "AnonHugePages") or 0


def huge_pages_pay(weight_bytes: int) -> bool:
    return weight_bytes >= HUGE_PAGES_FROM_WEIGHT_BYTES


def back_with_huge_pages(min_bytes: int = 4 * HUGE_PAGE, budget_s: float = HUGE_PAGES_BUDGET_S) -> int:
    """Move the process's large anonymous regions (the weights, once loaded) onto 2 MB pages; returns the bytes
    now backed by huge pages.

    Decode streams every weight once a token, and with 4 KB pages every 4 KB of it is one more TLB entry to find
    (docs/decisions.md, "Huge pages after load"). Distributions enable transparent huge pages only where a
    program asks ("madvise"), and PyTorch asks only with THP_MEM_ALLOC_ENABLE=1 and only for its own allocations
    (fbgemm's int8 weights are not), so this asks the kernel for each region. Runs once, at load, and stops after
    `budget_s`. Where the kernel cannot (not Linux, older than 6.1, huge pages disabled)
    nothing changes."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except (OSError, TypeError):
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    regions = []
    for line in lines:
        fields = line.split()
        anonymous = len(fields) < 6 or fields[5] == "[heap]"
        if not anonymous or "w" not in fields[1]:
            continue
        low, high = (int(value, 16) for value in fields[0].split("-"))
        start, end = -(-low // HUGE_PAGE) * HUGE_PAGE, high // HUGE_PAGE * HUGE_PAGE
        if end - start >= min_bytes:
            regions.append((start, end))
    deadline = time.perf_counter() + budget_s
    for start, end in sorted(regions, key=lambda region: region[0] - region[1]):
        for piece in range(start, end, COLLAPSE_PIECE):
            if time.perf_counter() >= deadline:
                return huge_page_bytes()
            # a part that cannot be collapsed stays as it was
            libc.madvise(piece, min(COLLAPSE_PIECE, end - piece), MADV_COLLAPSE)
    return huge_page_bytes()
