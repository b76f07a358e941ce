"""The CPU backend's host memory: freed activation memory kept for reuse (glibc malloc), so a prefill does not
page-fault its arrays in anew; and the pages of mapped GGUF tensors the engine has copied, released.

Why: every op of a CPU prefill allocates its outputs and temporaries fresh, megabytes each (a 128-token Qwen2.5
MLP: 128 x 4864 float32 = 2.4 MiB). glibc serves a block that large with its own mmap once it passes the
adaptive mmap threshold, or from the heap top that it trims back to the OS at 128 KiB of free space; either way
the next op's array is new memory, touched in page by page: 43,000 minor page faults (~170 MiB) a 128-token
Qwen2.5-0.5B prefill, measured. With blocks up to 32 MiB served from the heap and the heap top kept, the same
prefill faults none and runs ~1.2x faster (bench/e2e_cpu.py). The cost: the process keeps up to the peak of its
transient arrays resident after they are freed, where it would have returned them.

This is process-wide allocator state, so it is set only on glibc, and never where the user has tuned the
allocator already (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_: their setting stands).
"""
from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD_BYTES = 1 << 30  # free space at the heap top kept, up to this much
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (the same values each call: setting them again changes nothing);
    False where it is not glibc or the user set them."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl without mallopt): nothing to do
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD_BYTES))


def release_mapped_pages(data: np.ndarray) -> int:
    """Drop the pages of `data` from this process's resident memory where it is a view into a read-only mapped
    file (a GGUF tensor whose rows the engine has copied elsewhere, cpu_interleaved.py): the page cache keeps the
    file's bytes, so a later read of them faults them back in unchanged. Only whole pages inside the array;
    returns the bytes released (0 for any other array, or where the system cannot)."""
    owner = data
    while owner is not None and not isinstance(owner, mmap.mmap):  # (np.frombuffer's base: a memoryview of it)
        owner = owner.obj if isinstance(owner, memoryview) else getattr(owner, "base", None)
    if owner is None or owner.closed:
        return 0
    try:
        first_byte = np.frombuffer(owner, np.uint8, count=1)
        if first_byte.flags.writeable:  # (a writable or copy-on-write mapping may hold bytes the file does not)
            return 0
        start_address = first_byte.ctypes.data
        page = mmap.PAGESIZE
        offset = data.ctypes.data - start_address
        first, end = -(-offset // page) * page, (offset + data.nbytes) // page * page
        if end <= first:
            return 0
        owner.madvise(mmap.MADV_DONTNEED, first, end - first)  # (an ACCESS_READ mapping: nothing to lose)
    except (AttributeError, OSError, ValueError, TypeError):  # (no madvise here, or not this mapping's memory)
        return 0
    return end - first
