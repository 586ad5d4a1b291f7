"""Gives freed buffers back to the OS in long experiment processes (glibc ``mallopt``).

XLA:CPU allocates its buffers with ``malloc``. glibc serves a large block from its own mapping
(returned to the OS on ``free``) only above a threshold that it raises, after each such block
is freed, up to 32 MiB: from then on the multi-megabyte buffers of a prefill or a cache copy
come from the heap, and a heap gives memory back only from its top. An accuracy run at 8k
then held ~5 GB more than its live arrays (measured 2026-11-25: 11.5 GB resident, ~6.3 GB
live). A fixed threshold keeps every block above it in its own mapping; at 2k the resident
peak of five rows' prefill and decoding fell from 5.9 to 5.2 GB with the same wall time.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 4 << 20  # bytes: every buffer of 4 MiB or more gets its own mapping


def return_freed_memory(threshold: int = DEFAULT_THRESHOLD) -> bool:
  """Fixes glibc's mmap and trim thresholds at ``threshold`` bytes for this process.

  Returns:
    True if set; False where the C library is not glibc (nothing changes there).
  """
  if threshold <= 0:
    raise ValueError(f"threshold must be positive, got {threshold}")
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
  return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
      mallopt(_M_TRIM_THRESHOLD, threshold))
