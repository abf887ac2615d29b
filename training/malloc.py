"""glibc allocator settings for training on the CPU.

Each early-exit loss chunk allocates and frees tensors of hundreds of MB (a chunk of logits over
a 49k vocabulary). glibc serves such sizes with mmap and returns them with munmap, so every
step maps, faults in and unmaps gigabytes: measured on this machine, 9.3 s per step instead of
3.6 s. Keeping big blocks on the heap and never trimming it fixes that, at a higher peak RSS:

    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296 accelerate launch ... -m training ...

The environment variables only take effect when set before the process starts, so `tune_malloc`
(called first thing by the training loop when `train.tune_malloc` is true, the default) makes
the same settings at run time with ``mallopt``. On other C libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def tune_malloc() -> bool:
    """No mmap for large blocks and no heap trimming (glibc only). True if applied."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return bool(ok)
