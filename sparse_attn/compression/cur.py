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
kept. kvpress's windows start at the first token, and so do ours. Its random-projection option
(``use_random_leverage``, off by default there) is not implemented.
"""

from __future__ import annotations

import dataclasses

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
  """

  leverage: str = "kv_product"
  local_window: int = 16

  name = "cur"
  DEFAULTS = {"n_sink": 4}

  def __post_init__(self):
    super().__post_init__()
    if self.leverage not in LEVERAGES:
      raise ValueError(f"leverage must be one of {LEVERAGES}, got {self.leverage!r}")
    if isinstance(self.local_window, bool) or not isinstance(self.local_window, int) or (
        self.local_window < 0):
      raise ValueError(f"local_window must be an int >= 0, got {self.local_window!r}")

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the combined, window-normalised squared norms, summing to 1 per head."""
    del state, scale, n
    idx, inv = order.position_order(cache.pos, cache.valid)
    valid = order.take(cache.valid, idx)
    width = self.local_window or cache.pos.shape[-1]
    lev = [order.window_normalised(jnp.sum(order.take(x, idx).astype(jnp.float32) ** 2, -1),
                                   valid, width) for x in (cache.k, cache.v)]
    score = {"key": lev[0], "value": lev[1], "kv_avg": (lev[0] + lev[1]) / 2,
             "kv_product": lev[0] * lev[1]}[self.leverage]
    total = jnp.sum(score, axis=-1, keepdims=True)
    score = score / jnp.where(total > 0, total, 1.0)
    return order.take(score, inv)
