"""experiments.common.heap: freed multi-megabyte buffers leave the process."""

import pytest

from experiments.common import heap
from tests import isolated


def _resident_after_fragmenting(fix: bool) -> tuple[bool, int]:
  """Resident MiB held after 512 MiB of 8 MiB buffers were freed (one kept at the heap's top)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  done = heap.return_freed_memory() if fix else False
  big = np.ones((24 << 20) // 8)  # freeing a mapped 24 MiB block raises glibc's threshold
  del big
  chunks = [np.ones((8 << 20) // 8) for _ in range(64)]
  last = chunks[-1]
  del chunks
  with open("/proc/self/status") as f:
    rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) // 1024
  assert last.sum() > 0
  return done, rss


def test_freed_buffers_are_returned():
  fixed, rss_fixed = isolated.run(_resident_after_fragmenting, True)
  if not fixed:
    pytest.skip("not glibc: mallopt is unavailable")
  _, rss_default = isolated.run(_resident_after_fragmenting, False)
  assert rss_default - rss_fixed > 300, (rss_default, rss_fixed)  # ~500 MiB stays by default


def test_threshold_must_be_positive():
  with pytest.raises(ValueError, match="positive"):
    heap.return_freed_memory(0)


def test_available_memory_counts_what_the_kernel_can_reclaim():
  import os  # pylint: disable=g-import-not-at-top
  total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  got = heap.available_bytes()
  assert 0 < got <= total
  if os.path.exists("/proc/meminfo"):  # MemAvailable: free pages plus reclaimable cache
    with open("/proc/meminfo", encoding="ascii") as f:
      fields = dict(line.split(":", 1) for line in f)
    assert abs(got - int(fields["MemAvailable"].split()[0]) * 1024) < 256 << 20
