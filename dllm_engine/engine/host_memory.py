"""Keep freed host memory in the process on Linux/glibc (CPU inference).

Every forward allocates activations of a few MB ([batch, tokens, hidden] and the MLP's wider
tensors). glibc gives large freed blocks back to the OS (mmap'd chunks are unmapped, the heap top
is trimmed), so the next step's tensors are built on fresh pages and pay a page fault per page
(the kernel zeroes it on first touch), on every layer of every step. The cost grows with tensor
size: on the copy-only tiny-llada of commit ffd686a (`dual-cache`, 256 new tokens) batch 8 ran
~20% slower per token than batch 1 for the same work; with the thresholds below the two are
level. Raising the mmap threshold to glibc's maximum (32 MiB) and the trim threshold to 1 GiB lets
freed blocks be reused, as a caching allocator does on a GPU. The cost: the process keeps its
peak heap.

The setting is process-wide, so it is never applied behind the caller's back: ``LLM(...,
keep_freed_memory=True)`` applies it (library default: off, since the host process owns its
allocator), and the ``dllm`` commands do by default (``--no-keep-freed-memory`` opts out: the
engine owns that process, and its benchmarks are measured with it on). ``dllm bench`` prints
whether it is in effect."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**30

# Process-wide because the thing it records is: mallopt sets the thresholds of the one glibc
# allocator the process has, so no object could own them. Only ``keep_freed_memory`` sets it, from
# False to True, once; it changes speed and peak heap, never a result.
_thresholds_applied = False


def keep_freed_memory() -> bool:
    """Apply the thresholds once per process; True when they are in effect."""
    global _thresholds_applied
    if _thresholds_applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _thresholds_applied = (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
                           and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return _thresholds_applied


def is_kept() -> bool:
    """Whether this process applied the thresholds."""
    return _thresholds_applied


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux: /proc/self/statm); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
