"""ReSA Fig. 6: one attention layer's decode step split into estimation, attention, rectification.

The ``kernels`` engine of ``shape_e2e``'s child processes (``paper_runs`` plans its parts): for
one part (a named shape's attention heads, one context, batch 1) it fills one cache of random
K/V (``per_layer.Bench``) and times, round-robin (``timing.interleaved``), each looping
``steps_per_call`` steps on the device:

* ``dense``: dense attention's decode step (write + attend, ``per_layer``'s dense);
* ``step``: the method's whole decode step (write, estimation, attention) and its rectify pass
  (``[rectify pass]``: the last ``f`` tokens re-encoded densely, ReSA Sec. 2.2);
* ``estimation``: the method's block selection alone (``Method.select``: block scores + top-k);
* ``attention``: the sparse attention over a fixed selection alone (``kernels.sparse_decode``).

``rectification_ms`` is the rectify pass over ``f`` (amortised per token, as the paper adds it
to a step). Each loop feeds a step's result into the next query so no step is loop-invariant.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.latency_lib import per_layer, settings, shape_ours, shapes, timing
from sparse_attn import kernels


def _looped(fn, steps: int):
  """Jitted ``(q, cache) -> q'``: ``fn(q, cache) -> array`` ``steps`` times, each feeding a
  runtime factor of its result into the next query (no step can be hoisted or dropped)."""
  @jax.jit
  def run(q, cache):
    def one(_, q):
      x = jnp.sum(fn(q, cache).astype(jnp.float32))
      return q * (1.0 + 1e-30 * x).astype(q.dtype)
    return jax.lax.fori_loop(0, steps, one, q)
  return run


def measure(s, part: dict) -> dict:
  """Times one part (``shape``, ``dtype``, ``context``, ``method``); returns its fields."""
  config = shapes.model_config(part["shape"], part["dtype"])
  ls = settings.Settings(dict(s.values, num_heads=config.num_heads,
                              num_kv_heads=config.num_kv_heads, head_dim=config.head_dim))
  m = shape_ours.make_method(part["method"], ls)
  dense = per_layer.make_method("dense", ls)
  ctx, steps = part["context"], int(ls.steps_per_call)
  b = per_layer.Bench(ls, part["dtype"], ctx, max(8, m.rect_interval, m.window), ls.seed,
                      per_layer.cache_kinds([m, dense]))
  q = b.q[:, :, 0]
  sel = jax.jit(m.select)(q, b.cache)
  est = _looped(lambda q, c: m.select(q, c).n_valid, steps)
  att = _looped(lambda q, c: kernels.sparse_decode(q, c, sel, impl=m.impl,
                                                   interpret=m.interpret)[0], steps)
  cands = b.candidates(dense, "dense") + b.candidates(m, "step") + [
      timing.Candidate("estimation", lambda: est(q, b.cache), per_call=steps),
      timing.Candidate("attention", lambda: att(q, b.cache), per_call=steps)]
  selected = b.selected_tokens(m)
  b.kv_numpy = None
  timing.interleaved(cands, ls.warmup, ls.repeats, ls.max_seconds_per_context)
  ms = {c.name: c.median_s * 1e3 for c in cands}
  f = m.rect_interval
  rect = ms.get("step [rectify pass]", 0.0) / f if f else 0.0
  return dict(
      dense_ms=ms["dense"], step_ms=ms["step"], estimation_ms=ms["estimation"],
      attention_ms=ms["attention"], rectify_pass_ms=ms.get("step [rectify pass]"),
      rectification_ms=rect, sparse_total_ms=ms["step"] + rect,
      times_ms={c.name: [t * 1e3 for t in c.times] for c in cands},
      selected_tokens=selected, p_eff=selected / ctx, rect_interval=f,
      heads=[config.num_heads, config.num_kv_heads, config.head_dim], steps_per_call=steps,
      impl=kernels.resolve_impl(m.impl))


def run_parts(s, parts: list[dict], emit) -> None:
  """``shape_e2e``'s child protocol: ``emit("start", part)``, then ``emit("record", rec)``."""
  info = shape_ours.device_info()
  for part in parts:
    emit("start", part)
    rec = dict(part, engine="kernels", **info)
    try:
      rec.update(measure(s, part), status="ok")
    except Exception as e:  # pylint: disable=broad-except (one part's failure is its record)
      text = f"{type(e).__name__}: {e}"
      oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
      rec.update(status="skipped" if oom else "error", reason=text[:2000])
    emit("record", rec)
