"""Random eviction: the baseline every press is measured against (kvpress's ``RandomPress``).

Each slot's score is an independent uniform draw, so a budget keeps a uniformly random subset
of each head's tokens (the sinks excepted, as for every method here). The draw is a pure
function of ``seed`` and the cache shape: the same seed keeps the same slots in every layer and
every run, which kvpress's seeded press also does.
"""

from __future__ import annotations

import dataclasses

import jax

from sparse_attn.compression.base import CompressionMethod


@dataclasses.dataclass(frozen=True)
class RandomPress(CompressionMethod):
  """Random eviction: score ``~ U(0, 1)`` per slot.

  Attributes:
    seed: the PRNG seed of the draw (static).
  """

  seed: int = 0

  name = "random"
  SIGNAL = "keys"  # no signal: a random draw

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"seed must be an int, got {self.seed!r}")

  def scores(self, cache, state, scale, n):
    """``[B, K, T]`` uniform draws of ``jax.random.key(seed)``."""
    del state, scale, n
    return jax.random.uniform(jax.random.key(self.seed), cache.pos.shape)
