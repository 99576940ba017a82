"""The C allocator's settings for a process that moves array bytes as messages of about a
MiB (gRPC's Python messages, each a fresh ``bytes``).

glibc serves an allocation of 128 KiB or more with a fresh mmap until frees teach it a
higher threshold, and gives memory at the top of its heap back to the system beyond a
threshold of its own, so a stream of 1 MiB messages keeps mapping and unmapping pages: each
one faulted in and zeroed by the kernel, then dropped. Measured on the development machine
(BENCHMARKS.md, "Unmodified JAX"), a 64 MiB put through the controller's IFRT front end
cost its process 40-53 ms of CPU with glibc's defaults and 16-26 ms with both thresholds
fixed as ``keep_message_memory`` fixes them (either one alone did not help). The process
keeps up to TRIM_BYTES of freed memory for the next messages instead of returning it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("pathways.wire")

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_BYTES = 4 << 20  # allocations below this come from the heap, where freed ones are reused
TRIM_BYTES = 64 << 20  # free memory at the top of the heap kept for reuse, at most


def keep_message_memory() -> bool:
    """Set this process's malloc thresholds (MMAP_BYTES, TRIM_BYTES); False where the C
    library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    if not done:
        log.warning("the C library refused pathways' malloc thresholds; large transfers cost more CPU")
    return done
