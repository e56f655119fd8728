"""glibc's malloc tuned to keep freed activations in the process, set before MLX loads.

MLX's CPU allocator takes each operation's output from malloc and frees it when the
array dies. With glibc's defaults a freed block of more than a few MB goes back to the
kernel (munmap, or a trimmed arena heap), and the next one is faulted in again, page by
page, zeroed: a vision tower's activations then cost page faults on every image. With
blocks below MMAP_THRESHOLD kept in malloc's arenas and up to TRIM_THRESHOLD of free
memory kept at their top, a second tower reuses the first one's memory.
``MLXVLM_NO_MALLOC_TUNING=1`` opts out (``policy``).
"""

from __future__ import annotations

import ctypes
import sys

from mlxvlm.cpu import policy

# glibc's malloc thresholds (bytes) mlxvlm sets on Linux.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)

# What happened, for --verbose.
malloc_status: str = "not attempted"


def tune_malloc() -> None:
    """Keep freed activations in the process for the next operation to reuse."""
    global malloc_status
    if not sys.platform.startswith("linux"):
        malloc_status = "not used (glibc's malloc only)"
        return
    if policy.malloc_tuning_disabled():
        malloc_status = f"disabled by {policy.NO_MALLOC_TUNING_ENV}"
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc: another libc's mallopt numbers differ
    except AttributeError:
        malloc_status = "not used (not glibc)"
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        malloc_status = (f"blocks under {MMAP_THRESHOLD >> 20} MB reused, "
                         f"up to {TRIM_THRESHOLD >> 20} MB of free memory kept")
    else:
        malloc_status = "mallopt refused the thresholds"
