"""Budget rules: how many blocks (or tokens) a selector keeps, and which are forced in.

A budget is given the way the papers give it:
  * ``budget`` float in (0, 1]: a fraction of the current context (Quest, RESA);
  * ``budget`` int >= 1: a token count (Quest's "token budget");
  * ``p`` (with ``n_min``): ReSA's dynamic rule ``n = max(n_min, ceil(M * p))`` blocks, ``M`` the
    number of blocks in the context (Sun et al. 2025, Sec. 2.1, Eq. 4).
How the forced entries (sink tokens, local window) count is each paper's protocol, the option
``forced_count``:
  * ``"extra"`` (the default for ``budget``): the budget is what the selector chooses by score; the
    forced entries are a fixed budget on top (RESA, Yang et al. 2026, Sec. 5 "Additional
    Configuration": 4 sinks + 64 local tokens besides the 2.5% selected);
  * ``"inside"`` (the default for ReSA's ``p``): the forced entries count inside the budget (ReSA
    Eq. 4 counts its ``n_local`` blocks in ``n``; RetroAttention's 0.15 includes the current page).
``min_tokens`` is a floor on the budget (RetroAttention, Table 1: relative budget 0.15 with a
256-token minimum). The count never exceeds the context: a budget larger than the context selects
everything. A block selector left with nothing to choose by score (forced entries eating an
``"inside"`` budget) is refused by ``check`` rather than silently becoming StreamingLLM.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

FORCED_ACCOUNTING = ("extra", "inside")


def check_budget_value(b) -> None:
  """Raises the one ``ValueError`` every entry point gives for a bad ``budget`` value.

  Valid: a float fraction in (0, 1] or an int token count >= 1 (``parse_budget`` turns a
  user's number into one of these first).
  """
  if isinstance(b, bool) or not isinstance(b, (int, float)):
    raise ValueError(f"budget must be a float fraction or an int token count, got {b!r}")
  if isinstance(b, float) and not 0.0 < b <= 1.0:
    raise ValueError(f"a fractional budget must be in (0, 1], got {b}")
  if isinstance(b, int) and b < 1:
    raise ValueError(f"a token budget must be >= 1, got {b}")


def parse_budget(value) -> float | int:
  """A user's budget number (a flag, a config field) -> a fraction or a token count.

  A whole number above 1 is a token count even when it arrives as a float (``--budget=256``
  from a float flag); anything else keeps its type, so ``1.5`` is refused as a fraction
  outside (0, 1] instead of being truncated to 1 token. Raises ``check_budget_value``'s error.
  """
  if isinstance(value, (np.integer, np.floating)):
    value = value.item()
  if isinstance(value, float) and value > 1.0 and value.is_integer():
    value = int(value)
  check_budget_value(value)
  return value


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
    forced_count: ``"extra"`` (forced entries on top of the budget) or ``"inside"`` (counted in it);
      None picks ``"inside"`` for ReSA's ``p`` rule and ``"extra"`` otherwise.
    min_tokens: the budget never drops below this many tokens (RetroAttention's 256).
  """

  budget: float | int | None = 0.1
  p: float | None = None
  n_min: int = 16
  n_sink: int = 4
  local_window: int = 64
  n_local: int | None = None
  forced_count: str | None = None
  min_tokens: int = 0

  def __post_init__(self):
    if self.forced_count is None:
      object.__setattr__(self, "forced_count", "inside" if self.budget is None else "extra")
    if self.forced_count not in FORCED_ACCOUNTING:
      raise ValueError(f"forced_count must be one of {FORCED_ACCOUNTING}, got "
                       f"{self.forced_count!r}")
    b = self.budget
    if b is None and self.p is None:
      raise ValueError("give a budget (fraction or token count) or ReSA's p")
    if b is not None:
      check_budget_value(b)
    if self.p is not None and not 0.0 < self.p <= 1.0:
      raise ValueError(f"p must be in (0, 1], got {self.p}")
    for name in ("n_min", "n_sink", "local_window", "min_tokens"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.n_local is not None and self.n_local < 0:
      raise ValueError(f"n_local must be >= 0, got {self.n_local}")

  # ---- counts in units of `unit` tokens (block_size, or 1 for token-level selectors) ----

  def count(self, length, unit: int):
    """Entries granted by the budget rule alone at context ``length [B]`` -> ``[B]`` int32."""
    m = (length + unit - 1) // unit  # entries in the context
    if self.budget is None:
      n = jnp.maximum(self.n_min, jnp.ceil(m * self.p).astype(jnp.int32))
    elif isinstance(self.budget, float):
      tokens = self.budget * length.astype(jnp.float32)
      # / unit as a product with 2^-k when unit is a power of 2: exact either way, so the same
      # value, and no approximate division where a Triton kernel applies the rule
      # (``kernels.RowBudget``; Triton's f32 division is ``div.approx``).
      exact = unit & (unit - 1) == 0
      n = jnp.ceil(tokens * (1.0 / unit) if exact else tokens / unit).astype(jnp.int32)
    else:
      n = jnp.full_like(length, -(-self.budget // unit))
    return jnp.maximum(n, -(-self.min_tokens // unit)).astype(jnp.int32)

  def total(self, length, n_forced, unit: int):
    """Entries attended in all, forced included, at ``length [B]`` with ``n_forced [B]``."""
    n = self.count(length, unit)
    if self.forced_count == "extra":
      return (n + n_forced).astype(jnp.int32)
    return jnp.maximum(n, n_forced).astype(jnp.int32)

  def max_count(self, capacity: int, unit: int) -> int:
    """Static upper bound of ``count`` plus the forced entries, clipped to the capacity."""
    m = -(-capacity // unit)
    if self.budget is None:
      n = max(self.n_min, math.ceil(m * self.p))
    elif isinstance(self.budget, float):
      n = math.ceil(self.budget * capacity / unit)
    else:
      n = -(-self.budget // unit)
    n = max(n, -(-self.min_tokens // unit))
    return max(1, min(m, n + self.max_forced(unit)))

  def sink_entries(self, unit: int) -> int:
    """Leading entries of ``unit`` tokens that hold the ``n_sink`` sinks (static)."""
    return -(-self.n_sink // unit)

  def max_forced(self, unit: int) -> int:
    sink = self.sink_entries(unit)
    local = self.n_local if self.n_local is not None else -(-self.local_window // unit) + 1
    return sink + local

  def forced_span(self, length, unit: int):
    """The forced entries in closed form: ``(sink, start)``, an int and ``[B]`` int32, with
    ``forced == (idx < sink | idx >= start) & (idx * unit < length)`` (sinks: ``idx * unit <
    n_sink``; local: the last ``n_local`` entries, or those ending past ``length -
    local_window``, ``(idx + 1) * unit > length - local_window``, none for a 0 window)."""
    sink = self.sink_entries(unit)
    last = (length + unit - 1) // unit
    if self.n_local is not None:
      start = last - self.n_local
    elif self.local_window > 0:
      start = (length - self.local_window) // unit  # floor: exact for negative values too
    else:
      start = last
    return sink, start.astype(jnp.int32)

  def forced(self, length, num: int, unit: int):
    """``[B, num]`` bool: entries (of ``unit`` tokens) always attended at ``length [B]``."""
    idx = jnp.arange(num, dtype=jnp.int32)[None, :]
    sink, start = self.forced_span(length, unit)
    return ((idx < sink) | (idx >= start[:, None])) & (idx * unit < length[:, None])

  def n_forced(self, length, num: int, unit: int):
    """``[B]`` int32: ``sum(forced(length, num, unit), -1)`` without the mask (the sinks plus
    the local entries not among them, inside the ``min(ceil(length / unit), num)`` valid)."""
    m = jnp.minimum((length + unit - 1) // unit, num)
    sink, start = self.forced_span(length, unit)
    return (jnp.minimum(sink, m) + jnp.maximum(0, m - jnp.maximum(start, sink))).astype(
        jnp.int32)

  def accounting(self, context: int, unit: int) -> dict:
    """Tokens attended per selection head at a context of ``context`` tokens (host ints).

    Returns ``dict(forced=, chosen=, total=, context=)``: ``forced`` the sink and local tokens,
    ``chosen`` the tokens selected by score (whole entries of ``unit`` tokens), ``total`` their
    sum, never above ``context``. Adaptive rules (top-p, Ada-KV) give their upper bound.
    """
    context = int(context)
    if context <= 0:
      return dict(forced=0, chosen=0, total=0, context=context)
    ln = np.array([context], np.int32)
    m = -(-context // unit)
    forced = np.asarray(self.forced(ln, m, unit))[0]
    tokens = np.minimum(unit, context - np.arange(m) * unit)  # tokens per entry
    n_forced = int(forced.sum())
    total = min(m, int(np.asarray(self.total(ln, np.array([n_forced]), unit))[0]))
    chosen_entries = np.sort(tokens[~forced])[::-1][:max(0, total - n_forced)]
    f_tok, c_tok = int(tokens[forced].sum()), int(chosen_entries.sum())
    return dict(forced=f_tok, chosen=c_tok, total=f_tok + c_tok, context=context)

  @staticmethod
  def over_layers(acc: dict, num_layers: int, full_layers: int) -> dict:
    """``acc`` (``accounting``'s, a sparse layer's) with ``layers``, ``full_layers`` (of them,
    the layers that attend the whole ``acc["context"]``) and ``layer_mean``, the tokens a step
    reads per head averaged over the ``num_layers`` layers."""
    num_layers, full_layers = int(num_layers), int(full_layers)
    if not 0 <= full_layers <= num_layers:
      raise ValueError(f"full_layers={full_layers} must be in [0, num_layers={num_layers}]")
    mean = (full_layers * acc["context"] + (num_layers - full_layers) * acc["total"]) / num_layers
    return dict(acc, layers=num_layers, full_layers=full_layers, layer_mean=mean)

  def check(self, context: int, unit: int, name: str = "the selector"):
    """Raises ValueError when, at ``context`` tokens, nothing is chosen by score although
    some entries stay unattended (the selector would silently be StreamingLLM)."""
    acc = self.accounting(context, unit)
    if acc["chosen"] == 0 and acc["total"] < context:
      raise ValueError(
          f"{name} chooses 0 blocks by score at a context of {context} tokens: the budget "
          f"({self._describe()}, {unit}-token entries) is used up by {acc['forced']} forced "
          f"tokens (n_sink={self.n_sink}, local={self._local_desc()}, forced_count={self.forced_count!r}). "
          "Raise the budget, use forced_count='extra', or shrink the forced entries.")

  def _describe(self) -> str:
    if self.budget is None:
      return f"p={self.p}, n_min={self.n_min}"
    return f"budget={self.budget}" + (f", min_tokens={self.min_tokens}" if self.min_tokens else "")

  def _local_desc(self) -> str:
    return (f"n_local={self.n_local} blocks" if self.n_local is not None
            else f"local_window={self.local_window} tokens")
