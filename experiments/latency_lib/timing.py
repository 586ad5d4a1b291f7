"""Interleaved timing: every candidate runs once per round, medians over rounds.

The machines are shared and noisy; timing the methods round-robin (rather than one after the
other) exposes them to the same load, so their ratios hold within a run. Each round runs the
candidates in its own seeded random order, so no method always runs right after the same
neighbour (on a CPU the step after a dense scan of a large cache runs measurably slower) and
round ``i`` of two methods is a paired sample. Each call is synchronised
with ``jax.block_until_ready`` (torch CPU ops are synchronous) before the clock is read.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any, Callable

import jax


@dataclasses.dataclass
class Candidate:
  """A timed callable. ``fn()`` runs ``per_call`` steps and returns what to wait for.

  ``times`` are per step (each call's time over ``per_call``): on a GPU a call that loops over
  several steps on the device keeps the host's dispatch cost out of a microsecond step.
  """

  name: str
  fn: Callable[[], Any]
  times: list[float] = dataclasses.field(default_factory=list)
  first_s: float = 0.0  # first call (compilation included)
  per_call: int = 1

  @property
  def median_s(self) -> float:
    return statistics.median(self.times) if self.times else float("nan")


def call(fn) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - t0


def interleaved(cands: list[Candidate], warmup: int, repeats: int,
                max_seconds: float = float("inf"), min_repeats: int = 3) -> list[Candidate]:
  """Compiles and warms every candidate, then times ``repeats`` round-robin rounds.

  Rounds stop early (after ``min_repeats``) once ``max_seconds`` of timing have passed.
  """
  for c in cands:
    c.first_s = call(c.fn)
    for _ in range(warmup):
      call(c.fn)
  start = time.perf_counter()
  for r in range(repeats):
    order = list(cands)
    random.Random(r).shuffle(order)
    for c in order:
      c.times.append(call(c.fn) / c.per_call)
    if r + 1 >= min_repeats and time.perf_counter() - start > max_seconds:
      break
  return cands
