"""The C allocator's thresholds for a long-running service that handles large transient buffers.

A data-plane frame of a long prompt (512 KiB of token ids for 128k tokens), its decoded copy and
an HTTP body of token ids are allocated and freed on every request. glibc serves allocations of
128 KiB and more with a fresh mmap, and each one costs a page fault per 4 KiB page on first touch
and an munmap on free: about 0.5 ms per 128k-token LOOKUP here, a third of its latency. glibc
raises that threshold on its own after the first large free (its dynamic threshold), so a process
got the fast path only once something happened to trigger it (a readiness probe did).

`tune()` sets the thresholds at start instead: allocations up to MMAP_THRESHOLD come from the
heap, freed heap memory at the top is returned to the kernel only beyond TRIM_THRESHOLD, and the
heap grows TOP_PAD beyond each request. The cost is memory kept resident after a burst (at most
about TRIM_THRESHOLD + TOP_PAD: `bench footprint` measures it). Each value an operator set through
glibc's environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_) is left as
set. Anything but glibc: nothing is done.

Primitives: tune() -> {name: value set} (empty when not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 8 << 20
TRIM_THRESHOLD = 32 << 20
TOP_PAD = 16 << 20

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

_PARAMS = (
    ("mmap_threshold", _M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD),
    ("trim_threshold", _M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD),
    ("top_pad", _M_TOP_PAD, "MALLOC_TOP_PAD_", TOP_PAD),
)


def tune() -> dict[str, int]:
    """Set the thresholds the module docstring gives; returns those set."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return {}
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt parameters differ
        return {}
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done: dict[str, int] = {}
    for name, param, env, value in _PARAMS:
        if env in os.environ:
            continue
        if mallopt(param, value) == 1:
            done[name] = value
    return done
