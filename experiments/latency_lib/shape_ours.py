"""Our side of the named-shape benchmark: greedy decode and chunked prefill of a random model.

Letters: B batch, T cache capacity, K kv heads, D head dim, L layers.

Decode runs ``models.driver.Decoder`` (the one decode schedule ``models.generate`` steps: one
device program per token on a GPU, rectification included) over caches filled with random K/V
at the context length (the step's cost depends on the cache length, not on its contents; a
128k-token prefill per method would dominate the run). The first steps compile (and, for a
rectifying method, run one rectification); then ``repeats`` rounds of ``decode_steps`` steps
each are timed with one host sync per round (tokens stay on the device, as ``generate`` keeps
them), and the median round gives ms per step. Prefill runs ``models.decode.prefill`` on random
token ids plus the first sampled token (``transformers``' prefill also ends in the last
position's logits), timed after a one-chunk call that compiles the same step.

Every part first checks that its caches fit (``fits``: exact cache and state bytes from
``jax.eval_shape``, plus a margin) and reports a skip instead of running out of memory.
"""

from __future__ import annotations

import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import heap
from experiments.latency_lib import per_layer, random_cache, shapes, traffic
from models import decode, driver, steps as steps_lib
from models.sampling import Sampling
from sparse_attn import kernels, methods

MARGIN = 0.05  # of the device's memory, on top of 1 GiB: compiler scratch, logits, activations
# Steps a round's issue time is read from: fewer than the 32 executions PJRT's GPU client lets
# the host queue ahead of the device (xla/pjrt/pjrt_stream_executor_client.cc), so the host is
# never waiting for the device while they are issued.
ISSUE_PROBE_STEPS = 16


def make_method(spec: str, s):
  """A method of the config: a paper preset as it stands (only ``impl``/``interpret`` from the
  config), any other spec with the config's block size and ``e2e_budget_p``."""
  if spec.strip().lower() in methods.PRESETS:
    return methods.make(spec, impl=s.impl, interpret=s.interpret)
  return per_layer.make_method(spec, s, p=s.e2e_budget_p)


def device_info() -> dict:
  """Backend, device name, JAX version and the device's memory limit (bytes, or None)."""
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  return dict(backend=jax.default_backend(), device=dev.device_kind, jax=jax.__version__,
              device_bytes=stats.get("bytes_limit"))


def free_bytes() -> int:
  """Memory left on the device (host RAM available on a CPU)."""
  stats = jax.devices()[0].memory_stats()
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return heap.available_bytes()


def cache_bytes(config, m, batch: int, capacity: int) -> int:
  """Exact bytes of every layer's cache and method state (``jax.eval_shape``, no allocation)."""
  dt = jnp.dtype(config.dtype)
  one = jax.eval_shape(lambda: (
      m.init_cache(batch, config.num_kv_heads, capacity, config.head_dim, dt),
      m.init_state(batch, config.num_heads, config.num_kv_heads, config.head_dim, capacity, dt)))
  return config.num_layers * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one))


def fits(need: int) -> str | None:
  """None when ``need`` bytes fit on the device now, else the reason for a skip."""
  free = free_bytes()
  total = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", free)
  want = need + (1 << 30) + MARGIN * total
  if want <= free:
    return None
  return (f"memory: needs ~{want / 2**30:.1f} GiB (caches and states {need / 2**30:.1f} GiB "
          f"+ margin), {free / 2**30:.1f} GiB free on {jax.devices()[0].device_kind}")


def decoder(model, m, *, batch: int, context: int, steps: int):
  """``(Decoder, newest [batch])`` over caches of random K/V at ``context`` tokens with room
  for ``steps`` more, ready to step (``newest + i`` is step ``i``'s position); or the reason
  (a string) its caches do not fit."""
  config = model.config
  capacity = m.round_capacity(context + steps + m.window + 1)
  reason = fits(cache_bytes(config, m, batch, capacity))
  if reason:
    return reason
  caches, states = steps_lib.init_caches(config, m, batch, capacity)
  keys = jax.random.split(jax.random.key(1), config.num_layers)
  caches = [random_cache.fill(c, keys[i], context=context) for i, c in enumerate(caches)]
  caches, states = steps_lib.end_prefill(caches, states, config=config, method=m)
  loop = driver.Decoder(model, m, jnp.zeros((batch, capacity), jnp.int32), caches, states)
  return loop, np.full((batch,), context, np.int64)


def decode_part(model, m, *, batch: int, context: int, n_steps: int, repeats: int) -> dict:
  """Times greedy decode of ``batch`` rows past ``context`` cached tokens.

  Returns:
    ``dict(step_ms=, times_ms=, dispatch_ms=, first_call_s=, steps=, warmup_steps=)`` or
    ``dict(skip=)``; ``dispatch_ms``: the host's time to issue one step, from the first
    ``dispatch_steps`` of a round (``ISSUE_PROBE_STEPS``): past PJRT's 32 executions queued
    ahead of a GPU the host waits for the device, so over a whole round the issue time would
    only repeat the step time.
  """
  f = m.rect_interval
  n_steps = -(-n_steps // f) * f if f else n_steps  # whole rectification periods per round
  warm = max(2, f)  # compiles the step (and the rectification, which runs after step f)
  total = warm + repeats * n_steps
  got = decoder(model, m, batch=batch, context=context, steps=total)
  if isinstance(got, str):
    return dict(skip=got)
  loop, newest = got
  step_keys = list(jax.random.split(jax.random.key(2), total))  # made before any clock runs
  probe = min(n_steps, ISSUE_PROBE_STEPS)

  def run(i0: int, n: int) -> tuple[float, float]:
    """Seconds until the host has issued the first ``min(n, ISSUE_PROBE_STEPS)`` of ``n``
    steps (from an idle device), and until the device finished all ``n``."""
    last_probed = i0 + min(n, ISSUE_PROBE_STEPS) - 1
    t0 = time.perf_counter()
    for i in range(i0, i0 + n):
      nxt, _ = loop.step(newest + i, step_keys[i])
      if i == last_probed:
        issued = time.perf_counter() - t0
    jax.block_until_ready((nxt, loop.caches, loop.states))
    return issued, time.perf_counter() - t0

  first = run(0, 1)[1]
  run(1, warm - 1)
  rounds = [run(warm + r * n_steps, n_steps) for r in range(repeats)]
  times = [t / n_steps for _, t in rounds]
  del loop
  gc.collect()
  # dispatch_ms close to step_ms: the host sets the pace, not the device
  return dict(step_ms=statistics.median(times) * 1e3, times_ms=[t * 1e3 for t in times],
              dispatch_ms=statistics.median(d / probe for d, _ in rounds) * 1e3,
              dispatch_steps=probe, first_call_s=first, steps=n_steps, warmup_steps=warm)


def prefill_part(model, m, *, batch: int, context: int, chunk: int) -> dict:
  """Times the chunked prefill of ``batch`` random prompts of ``context`` tokens.

  Returns:
    ``dict(seconds=, first_call_s=)`` or ``dict(skip=)``.
  """
  config = model.config
  capacity = m.round_capacity(context + 8)
  reason = fits(cache_bytes(config, m, batch, capacity))
  if reason:
    return dict(skip=reason)
  ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, context), np.int32)

  def run(n: int) -> float:
    t0 = time.perf_counter()
    last, *rest = decode.prefill(model, ids[:, :n], np.full((batch,), n, np.int32), m,
                                 capacity, chunk)
    nxt, _ = steps_lib.sample_from_hidden(model.params, last, jax.random.key(0),
                                          config=config, sampling=Sampling())
    jax.block_until_ready((nxt, rest))
    del last, rest
    return time.perf_counter() - t0

  first = run(min(chunk, context))  # the same compiled chunk step as the whole prompt's
  sec = run(context)
  gc.collect()
  return dict(seconds=sec, first_call_s=first)


def run_parts(s, parts: list[dict], emit) -> None:
  """Runs ``parts`` (dicts with ``key, phase, batch, context, method``) on one random model of
  the config's shape, calling ``emit("start", part)`` before and ``emit("record", rec)`` after
  each."""
  config = shapes.model_config(s.shape, s.shape_dtype)
  info = device_info()
  peak, source = traffic.peak_gbs_for(info["device"], s.peak_bandwidth_gbs)
  t0 = time.perf_counter()
  model = shapes.random_model(config, s.seed)
  jax.block_until_ready(model.params)
  init_s = time.perf_counter() - t0
  wb = shapes.weight_bytes
  for part in parts:
    emit("start", part)
    b, ctx = part["batch"], part["context"]
    rec = dict(part, engine="ours", peak_gbs=peak or None, peak_source=source,
               fused=steps_lib.fused_by_default(), model_init_s=init_s, **info)
    try:
      m = make_method(part["method"], s)
      rec["impl"] = kernels.resolve_impl(m.impl)
      if part["phase"] == "decode":
        got = decode_part(model, m, batch=b, context=ctx, n_steps=s.shape_decode_steps,
                          repeats=s.shape_repeats)
        weights, kv = wb(config, b)["total"], shapes.kv_bytes(m, config, context=ctx, batch=b)
        rec.update(weight_bytes=weights, kv_bytes=kv)
        if "step_ms" in got:
          got.update(tok_s=b / got["step_ms"] * 1e3,
                     **shapes.bound(got["step_ms"] / 1e3, weights, kv, peak))
      else:
        got = prefill_part(model, m, batch=b, context=ctx, chunk=s.shape_prefill_chunk)
        if "seconds" in got:
          got.update(tok_s=b * ctx / got["seconds"], chunk=s.shape_prefill_chunk,
                     bound_flag="prefill: compute-bound, no bandwidth bound")
      skip = got.pop("skip", None)
      rec.update(got, status="skipped" if skip else "ok", reason=skip)
    except Exception as e:  # pylint: disable=broad-except (one part's failure is its record)
      text = f"{type(e).__name__}: {e}"
      oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
      rec.update(status="skipped" if oom else "error", reason=("memory: " if oom else "") +
                 text[:2000])
      gc.collect()
    emit("record", rec)
