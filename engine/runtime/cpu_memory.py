"""Keep freed memory in the process on CPU, so that per-round temporaries do not page-fault.

glibc hands every large freed block back to the kernel (blocks above a dynamic mmap threshold
are unmapped, the heap top is trimmed), so the next temporary of the same size faults its pages
in again. In a one-off measurement on the 2-core development machine (a throwaway script, not
kept) that roughly doubled the cost of the LoCo compensate/encode/update of a 4.9M-value
gradient, and the setting took about 11% off a GPT-2 6x256 forward+backward; the benchmark runs
every mode with the same setting, so its tables do not depend on it. Training allocates the same sizes every round, so keeping
the memory costs nothing in steady state. Set once, as early as possible (threads that already
own an arena keep it). Process-wide; the same as starting Python with
``MALLOC_ARENA_MAX=1 MALLOC_TRIM_THRESHOLD_=<huge> MALLOC_MMAP_MAX_=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("acco_loco")

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc (one arena, no trimming, no mmap'd blocks); False where not glibc."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = (mallopt(_M_ARENA_MAX, 1) == 1) & (mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1) \
        & (mallopt(_M_MMAP_MAX, 0) == 1)
    if not ok:
        log.debug("mallopt refused a setting: freed memory may go back to the kernel")
    _done = ok
    return ok
