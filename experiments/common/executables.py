"""Compiled programs of long experiment processes, released before they exhaust the kernel's
limit on memory mappings.

XLA:CPU maps every program it compiles into about three mappings of its own (code, read-only
data, data) and keeps them while JAX's caches hold the program. A long run compiles thousands:
a per-layer decode step per method, kept fraction and cache shape, and the cache shapes of
methods whose layers keep different counts (Ada-KV head budgets, KVzip ranked over all layers)
change with every batch. Linux allows ``vm.max_map_count`` mappings per process (65,530 by
default); past it, LLVM fails to allocate ("LLVM compilation error: Cannot allocate memory")
and the process dies in ``backend_compile_and_load`` with a segmentation fault, while gigabytes
of memory are free. Measured 2026-11-29: the compression board's KVzip run held 20,600
mappings (6,860 programs) after 60 samples at 4k, and four of its runs had died this way.

``release_if_crowded`` drops JAX's in-memory caches once the process holds more than a share
of the limit; the programs still needed are compiled again (or read back from JAX's persistent
compilation cache where ``JAX_COMPILATION_CACHE_DIR`` is set). Results do not change: the
same programs come back.
"""

from __future__ import annotations

import gc
import sys

import jax

DEFAULT_SHARE = 0.5  # of the limit; one batch of a long run compiles well under the other half


def mapping_count(maps: str = "/proc/self/maps") -> int | None:
  """Memory mappings this process holds (None where ``/proc`` cannot tell)."""
  try:
    with open(maps, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def mapping_limit(limit: str = "/proc/sys/vm/max_map_count") -> int | None:
  """The kernel's per-process mapping limit (None where ``/proc`` cannot tell)."""
  try:
    with open(limit) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


def release_if_crowded(share: float = DEFAULT_SHARE, *, count=None, limit=None,
                       stream=None) -> bool:
  """Clears JAX's compilation caches if this process holds more than ``share`` of its
  mapping limit; call it between units of work (a batch, a method). Returns whether it did.

  Args:
    share: the fraction of the limit that triggers a release, in (0, 1].
    count, limit: readers of the current count and of the limit (default: ``mapping_count``,
      ``mapping_limit``).
    stream: where the one-line notice goes (default stderr).
  """
  if not 0 < share <= 1:
    raise ValueError(f"share must be in (0, 1], got {share}")
  count, limit = count or mapping_count, limit or mapping_limit
  held, most = count(), limit()
  if held is None or most is None or held <= share * most:
    return False
  jax.clear_caches()
  gc.collect()
  after = count()
  print(f"released compiled programs: {held} -> {after} memory mappings (limit {most})",
        file=stream or sys.stderr, flush=True)
  return True
