"""Budget rules: how many blocks (or tokens) a selector keeps, and which are forced in.

A budget is given the way the papers give it:
  * ``budget`` float in (0, 1]: a fraction of the current context (Quest, RESA);
  * ``budget`` int >= 1: a token count (Quest's "token budget");
  * ``p`` (with ``n_min``): ReSA's dynamic rule ``n = max(n_min, ceil(M * p))`` blocks, ``M`` the
    number of blocks in the context (Sun et al. 2025, Sec. 2.1, Eq. 4).
The count includes the forced entries (sink tokens, local window); when the forced entries alone
exceed it, all of them are kept. The count never exceeds the context: a budget larger than the
context selects everything.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Budget:
  """Static budget configuration (hashable, a jit static argument).

  Attributes:
    budget: fraction of the context (float in (0, 1]) or token count (int >= 1); None with
      ``p`` set means ReSA's rule.
    p: ReSA sparsity ratio (fraction of blocks), used when ``budget`` is None.
    n_min: ReSA's minimum block count.
    n_sink: leading sink tokens always attended (StreamingLLM / Quest practice).
    local_window: trailing tokens always attended (ignored when ``n_local`` is set).
    n_local: trailing blocks always attended (ReSA's ``n_local``); None = use ``local_window``.
  """

  budget: float | int | None = 0.1
  p: float | None = None
  n_min: int = 16
  n_sink: int = 4
  local_window: int = 64
  n_local: int | None = None

  def __post_init__(self):
    b = self.budget
    if b is None and self.p is None:
      raise ValueError("give a budget (fraction or token count) or ReSA's p")
    if isinstance(b, bool):
      raise ValueError(f"budget must be a number, got {b!r}")
    if isinstance(b, float) and not 0.0 < b <= 1.0:
      raise ValueError(f"a fractional budget must be in (0, 1], got {b}")
    if isinstance(b, int) and b < 1:
      raise ValueError(f"a token budget must be >= 1, got {b}")
    if b is not None and not isinstance(b, (int, float)):
      raise ValueError(f"budget must be a float fraction or an int token count, got {b!r}")
    if self.p is not None and not 0.0 < self.p <= 1.0:
      raise ValueError(f"p must be in (0, 1], got {self.p}")
    for name in ("n_min", "n_sink", "local_window"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.n_local is not None and self.n_local < 0:
      raise ValueError(f"n_local must be >= 0, got {self.n_local}")

  # ---- counts in units of `unit` tokens (block_size, or 1 for token-level selectors) ----

  def count(self, length, unit: int):
    """Entries granted by the budget alone at context ``length [B]`` -> ``[B]`` int32."""
    m = (length + unit - 1) // unit  # entries in the context
    if self.budget is None:
      n = jnp.maximum(self.n_min, jnp.ceil(m * self.p).astype(jnp.int32))
    elif isinstance(self.budget, float):
      n = jnp.ceil(self.budget * length.astype(jnp.float32) / unit).astype(jnp.int32)
    else:
      n = jnp.full_like(length, -(-self.budget // unit))
    return n.astype(jnp.int32)

  def max_count(self, capacity: int, unit: int) -> int:
    """Static upper bound of ``count`` plus the forced entries, clipped to the capacity."""
    m = -(-capacity // unit)
    if self.budget is None:
      n = max(self.n_min, math.ceil(m * self.p))
    elif isinstance(self.budget, float):
      n = math.ceil(self.budget * capacity / unit)
    else:
      n = -(-self.budget // unit)
    return max(1, min(m, n + self.max_forced(unit)))

  def max_forced(self, unit: int) -> int:
    sink = -(-self.n_sink // unit)
    local = self.n_local if self.n_local is not None else -(-self.local_window // unit) + 1
    return sink + local

  def forced(self, length, num: int, unit: int):
    """``[B, num]`` bool: entries (of ``unit`` tokens) always attended at ``length [B]``."""
    idx = jnp.arange(num, dtype=jnp.int32)[None, :]
    ln = length[:, None]
    sink = idx * unit < self.n_sink
    if self.n_local is not None:
      last = (ln + unit - 1) // unit
      local = idx >= last - self.n_local
    else:
      local = ((idx + 1) * unit > ln - self.local_window) & (self.local_window > 0)
    return (sink | local) & (idx * unit < ln)
