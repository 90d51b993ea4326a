"""Keep CPU activations in the heap: glibc ``mallopt`` for the CPU engine.

Why: PyTorch's CPU allocator is glibc ``malloc``. A forward allocates and frees the same sizes
every layer (a 512-token prefill chunk: 1-6 MiB activations). glibc serves blocks above its mmap
threshold with fresh ``mmap`` pages and gives freed heap tops back to the kernel, so each of those
tensors page-faults all its pages in again (the kernel zeroes every page). That makes elementwise
ops, which should be bound by their memory traffic, pay for page faults instead, and prefill steps
with them (figures in docs/design-history.md, "glibc malloc on the CPU engine", and docs/benchmarks.md).

:func:`tune` raises the mmap threshold to glibc's maximum (32 MiB) and stops trimming below
1 GiB, so freed activations are reused in place: the process keeps up to that much freed memory
mapped, which an inference server, whose next step needs the same sizes again, wants anyway.
It is process-wide, applied once, glibc only (elsewhere it does nothing and says why), and
``LOCKGATE_NO_MALLOC_TUNING=1`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

log = logging.getLogger(__name__)

# glibc <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_lock = threading.Lock()
_result: str | None = None


def tune() -> str:
    """Apply the settings once per process; returns what was done (also on later calls)."""
    global _result
    with _lock:
        if _result is None:
            _result = _apply()
            log.info("malloc tuning: %s", _result)
        return _result


def _apply() -> str:
    if os.environ.get("LOCKGATE_NO_MALLOC_TUNING", "") not in ("", "0"):
        return "off (LOCKGATE_NO_MALLOC_TUNING)"
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "skipped: no glibc mallopt here"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [name for name, param, value in (("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                            ("trim_threshold", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                                            ("top_pad", M_TOP_PAD, TOP_PAD)) if mallopt(param, value) == 1]
    return "applied " + ", ".join(done) if done else "glibc refused every setting"
