"""Keep memory the engine frees inside the process instead of handing it back to the OS.

glibc serves an allocation above its mmap threshold with a fresh mapping and unmaps it on
free, and gives the heap's free top back once it passes the trim threshold (both start small
and move with what the process does). A step's activations then arrived as new pages, each
one a page fault in which the kernel zeroes it (in a VM the host may have to back it again):
in-engine, 32 prompts of 128 tokens and 32 output tokens each, 200-400K minor faults per round
on every round; with the thresholds below, ~12K in the first round and ~10 after. vLLM gets
the same effect by preloading tcmalloc.

The cost: up to TRIM_THRESHOLD of freed memory stays with the process after a burst (memory
it used a moment before). Allocations above 32 MiB, glibc's largest mmap threshold, are still
mapped per use. Where MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set, the user's
setting stands.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's thresholds for this process; False where not applied (not glibc, or the
    user's environment sets them)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
