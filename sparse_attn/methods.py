"""The method registry: spec strings -> frozen method configs with pure per-layer functions.

``make("quest", budget=0.05)`` returns a :class:`Method`, a frozen hashable dataclass (a static
argument under ``jax.jit``). Per layer the model calls, with post-RoPE ``q [B, Hq, S, D]``,
``k, v [B, Hkv, S, D]`` and token ``positions [B, S]`` (-1 = padding, not written):

  cache = m.init_cache(batch, num_kv_heads, capacity, head_dim, dtype)
  state = m.init_state(batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype)
  out, cache, state = m.prefill(q, k, v, cache, state, positions, scale=s)   # dense, causal
  cache, state = m.end_prefill(cache, state, scale=s)                         # after the prompt
  out, cache, state = m.decode(q, k, v, cache, state, positions, scale=s)    # S == m.window
  out, cache, state = m.rectify(q, k, v, cache, state, positions, scale=s)   # every rect_interval

``make("dense")`` is exact attention, the reference every other method is tested against.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp

from sparse_attn import reference, scoring, selection, sparse
from sparse_attn.budget import Budget
from sparse_attn.cache import KVCache, init_cache, write
from sparse_attn.spec import parse_spec

# name -> fn(method, q [B, Hq, D], cache, scale) -> Selection
SELECTORS: dict[str, Callable[..., selection.Selection]] = {
    "quest": lambda m, q, c, s: selection.quest(q, c, m.budget, m.gqa),
    "arkvale": lambda m, q, c, s: selection.arkvale(q, c, m.budget, m.gqa, m.variant),
    "topk": lambda m, q, c, s: selection.topk(q, c, m.budget, m.gqa, s),
    "streaming": lambda m, q, c, s: selection.streaming(q, c, m.budget),
}
BASE_NAMES = ("dense",) + tuple(SELECTORS)

COMMON_OPTIONS = ("block_size", "impl", "interpret")
BUDGET_OPTIONS = ("budget", "p", "n_min", "n_local", "n_sink", "local_window")
SELECTOR_OPTIONS = BUDGET_OPTIONS + ("gqa", "variant")


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding attention method (static configuration; all functions are pure).

  Attributes:
    spec: the canonical spec string.
    selector: ``"dense"`` or a key of ``SELECTORS``.
    budget: the selector's budget rule (None for dense).
    block_size: cache block (page) size.
    gqa: ``"head"`` (per query head selection) or ``"group"`` (shared by the kv group).
    variant: ArkVale bounding volume (``"sphere"`` or ``"cuboid"``).
    impl: ``"auto" | "pallas" | "xla"`` for the attention ops.
    interpret: run Pallas kernels in interpret mode.
  """

  spec: str = "dense"
  selector: str = "dense"
  budget: Budget | None = None
  block_size: int = 16
  gqa: str = "head"
  variant: str = "sphere"
  impl: str = "auto"
  interpret: bool = False

  # ---- schedule flags the decode loop obeys ----
  @property
  def window(self) -> int:
    """Queries per head in a decode step (RetroAttention's window; 1 otherwise)."""
    return 1

  @property
  def rect_interval(self) -> int:
    """Re-encode densely every this many generated tokens (0 = never)."""
    return 0

  @property
  def is_dense(self) -> bool:
    return self.selector == "dense"

  def round_capacity(self, n: int) -> int:
    """The smallest valid capacity (a multiple of ``block_size``) holding ``n`` tokens."""
    return max(1, -(-int(n) // self.block_size)) * self.block_size

  # ---- per-layer functions ----
  def init_cache(self, batch, num_kv_heads, capacity, head_dim, dtype=jnp.float32) -> KVCache:
    return init_cache(batch, num_kv_heads, capacity, head_dim, self.block_size, dtype)

  def init_state(self, batch, num_q_heads, num_kv_heads, head_dim, capacity,
                 dtype=jnp.float32) -> Any:
    del batch, num_q_heads, num_kv_heads, head_dim, capacity, dtype
    return {}

  def prefill(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Writes the chunk and attends it densely and causally over the cache.

    Returns ``(out [B, Hq, S, D], cache, state)``.
    """
    cache = write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), positions)
    out, _ = dense_over_cache(q, cache, positions, scale)
    return out, cache, state

  def end_prefill(self, cache: KVCache, state, *, scale=None):
    del scale
    return cache, state

  def rectify(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Dense re-encoding of recent tokens (overwrites their K/V); same contract as prefill."""
    return self.prefill(q, k, v, cache, state, positions, scale=scale)

  def select(self, q, cache: KVCache, scale=None) -> selection.Selection:
    """The selection of the current queries ``q [B, Hq, D]``."""
    return SELECTORS[self.selector](self, q, cache, scale)

  def attend(self, q, cache: KVCache, positions, scale=None):
    """Decode attention of ``q [B, Hq, D]`` at ``positions [B]`` -> ``(out, lse)``."""
    if self.is_dense:
      out, lse = dense_over_cache(q[:, :, None], cache, positions[:, None], scale)
      return out[:, :, 0], lse[:, :, 0]
    sel = self.select(q, cache, scale)
    return sparse.sparse_decode(q, cache, sel, scale, impl=self.impl, interpret=self.interpret)

  def decode(self, q, k, v, cache: KVCache, state, positions, *, scale=None):
    """Appends the new token's K/V and attends. ``q [B, Hq, 1, D]`` -> ``out [B, Hq, 1, D]``."""
    if q.shape[2] != self.window:
      raise ValueError(f"{self.spec} decodes {self.window} query per step, got {q.shape[2]}")
    cache = write(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype), positions)
    out, _ = self.attend(q[:, :, 0], cache, positions[:, 0], scale)
    return out[:, :, None], cache, state


def dense_over_cache(q, cache: KVCache, positions, scale=None):
  """Causal exact attention of ``q [B, Hq, S, D]`` at ``positions [B, S]`` over the cache."""
  return reference.attention(q, cache.k, cache.v, scale=scale, kv_length=cache.length,
                             q_positions=positions, k_positions=cache.pos)


def _check_options(name: str, options: dict, valid: tuple[str, ...]):
  bad = sorted(set(options) - set(valid))
  if bad:
    raise ValueError(f"unknown option(s) {bad} for {name!r}; valid options: {sorted(valid)}")


def _budget_from(options: dict) -> Budget:
  kw = {k: options[k] for k in BUDGET_OPTIONS if k in options}
  if "p" in kw and kw["p"] is not None:
    if kw.get("budget") is not None:
      raise ValueError("give either budget or ReSA's p, not both")
    kw["budget"] = None
    kw.setdefault("n_local", 1)  # ReSA's defaults (Sec. 3): n_min=16, n_local=1
  return Budget(**kw)


def make(spec: str = "dense", **options) -> Method:
  """Builds a method from a spec string and options.

  Args:
    spec: ``"dense"``, ``"quest"``, ``"arkvale"``, ``"topk"``, ``"streaming"`` (options may
      also be given inline: ``"quest:gqa=group"``).
    **options: ``budget`` (float fraction in (0, 1] or int token count), ``p`` / ``n_min`` /
      ``n_local`` (ReSA's dynamic rule), ``n_sink``, ``local_window``, ``gqa``, ``variant``,
      ``block_size``, ``impl``, ``interpret``.

  Raises:
    ValueError: unknown names or options, or invalid values (the message lists valid ones).
  """
  from sparse_attn import compression  # pylint: disable=g-import-not-at-top (registry cycle)
  parts = parse_spec(spec)
  (name, inline), rest = parts[0], parts[1:]
  if name in compression.BUILDERS:
    return compression.BUILDERS[name](spec, parts, options)
  if name not in BASE_NAMES:
    valid = sorted(BASE_NAMES + tuple(compression.BUILDERS))
    raise ValueError(f"unknown method {name!r} in {spec!r}; valid: {valid}")
  if rest:
    raise ValueError(f"unknown enhancer(s) {[n for n, _ in rest]} in {spec!r}")
  opts = {**inline, **options}
  valid = COMMON_OPTIONS + (() if name == "dense" else SELECTOR_OPTIONS)
  _check_options(name, opts, valid)
  impl = opts.get("impl", "auto")
  sparse.resolve_impl(impl)
  block_size = int(opts.get("block_size", 16))
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  common = dict(spec=spec, selector=name, block_size=block_size, impl=impl,
                interpret=bool(opts.get("interpret", False)))
  if name == "dense":
    return Method(**common)
  gqa = opts.get("gqa", "head")
  if gqa not in scoring.GQA_MODES:
    raise ValueError(f"gqa must be one of {scoring.GQA_MODES}, got {gqa!r}")
  variant = opts.get("variant", "sphere")
  if variant not in scoring.ARKVALE_VARIANTS:
    raise ValueError(f"variant must be one of {scoring.ARKVALE_VARIANTS}, got {variant!r}")
  return Method(**common, budget=_budget_from(opts), gqa=gqa, variant=variant)
