"""Keep freed host memory in the process on Linux/glibc (CPU inference).

Every forward allocates activations of a few MB ([batch, tokens, hidden] and the MLP's wider
tensors). glibc serves blocks above its mmap threshold with fresh ``mmap`` pages and trims the
heap top back to the OS on free, so each such tensor pays page faults (the kernel zeroes every page
on first touch) on every layer of every step. At batch 8 on tiny-llada that was ~20% of a
`dual-cache` run's wall time; batch 1's smaller tensors stayed under the threshold. Raising the
mmap threshold to glibc's maximum (32 MiB) and the trim threshold to 1 GiB lets freed blocks be
reused instead, as a caching allocator does on a GPU. The cost: the process keeps its peak heap.

Set ``DLLM_KEEP_FREED_MEMORY=0`` to leave glibc's defaults alone."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**30

_applied = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; True when they are in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("DLLM_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
