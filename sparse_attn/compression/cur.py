"""CurDKV: keep the tokens with the largest key and value leverage (arXiv 2509.15038).

Sengupta, Chaudhary and Chakraborty, "Value-Guided KV Compression for LLMs via Approximated CUR
Decomposition" (NeurIPS 2025).

CurDKV rates a token by the leverage of its row in a head's key and value matrices (the rows a
CUR decomposition would keep). As kvpress's ``CURPress`` computes it (the defaults here are
its): the leverage is approximated by the squared row norms ``||k_t||^2`` and ``||v_t||^2``,
each normalised over a local window of ``local_window`` consecutive tokens (so a few
large-norm tokens do not take the whole budget), combined as their product
(``leverage="kv_product"``; ``key``, ``value`` or ``kv_avg`` the alternatives) and normalised to
sum to 1 per head (comparable across heads under Ada-KV); the first ``n_sink = 4`` tokens are
kept. kvpress's windows start at the first token, and so do ours. kvpress's random-projection
option (``use_random_leverage``, off by default there) is ``random_leverage``: keys and values
are first multiplied by one Gaussian ``G ~ N(0, 1/r)^{D x r}`` (``r = rank = 20``, kvpress's),
a Johnson-Lindenstrauss sketch of the row norms; ``G`` is a JAX draw of ``jax.random.key(seed)``
(kvpress: torch's global generator, a new draw per layer; here one per seed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn.compression import order
from sparse_attn.compression.base import CompressionMethod

LEVERAGES = ("key", "value", "kv_avg", "kv_product")


@dataclasses.dataclass(frozen=True)
class CUR(CompressionMethod):
  """CurDKV eviction (arXiv 2509.15038): approximate key/value leverage per token.

  Attributes:
    leverage: ``kv_product`` (default), ``kv_avg``, ``key`` or ``value``.
    local_window: tokens per normalisation window (0: normalise over the whole head).
    random_leverage: project keys and values on a Gaussian ``[D, rank]`` first (kvpress's
      ``use_random_leverage``).
    rank: the projection's columns ``r``.
    seed: PRNG seed of the projection.
  """

  leverage: str = "kv_product"
  local_window: int = 16
  random_leverage: bool = False
  rank: int = 20
  seed: int = 0

  name = "cur"
  SIGNAL = "keys"  # key and value leverage
  DEFAULTS = {"n_sink": 4}

  def __post_init__(self):
    super().__post_init__()
    if self.leverage not in LEVERAGES:
      raise ValueError(f"leverage must be one of {LEVERAGES}, got {self.leverage!r}")
    if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) or (
        self.local_window < 0):
      raise ValueError(f"local_window must be an int >= 0, got {self.local_window!r}")
    if not isinstance(self.random_leverage, bool):
      raise ValueError(f"random_leverage must be a bool, got {self.random_leverage!r}")
    for f in ("rank", "seed"):
      x = getattr(self, f)
      if isinstance(x, bool) or not isinstance(x, int) or x < (1 if f == "rank" else 0):
        raise ValueError(f"{f} must be an int >= {1 if f == 'rank' else 0}, got {x!r}")

  def projection(self, head_dim: int):
    """``[D, rank]`` float32 ``G ~ N(0, 1/rank)`` of ``random_leverage`` (from
    ``jax.random.key(seed)``)."""
    return jax.random.normal(jax.random.key(self.seed), (head_dim, self.rank)) / jnp.sqrt(
        jnp.float32(self.rank))

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the combined, window-normalised squared norms, summing to 1 per head."""
    del state, scale, n
    idx, inv = order.position_order(cache.pos, cache.valid)
    valid = order.take(cache.valid, idx)
    width = self.local_window or cache.pos.shape[-1]
    rows = [x.astype(jnp.float32) for x in (cache.k, cache.v)]
    if self.random_leverage:
      g = self.projection(cache.head_dim)
      rows = [x @ g for x in rows]
    lev = [order.window_normalised(jnp.sum(order.take(x, idx) ** 2, -1), valid, width)
           for x in rows]
    score = {"key": lev[0], "value": lev[1], "kv_avg": (lev[0] + lev[1]) / 2,
             "kv_product": lev[0] * lev[1]}[self.leverage]
    total = jnp.sum(score, axis=-1, keepdims=True)
    score = score / jnp.where(total > 0, total, 1.0)
    return order.take(score, inv)
