"""KV-cache bytes and peak RSS: dense vs compression (Expected Attention), one subprocess each.

Each configuration runs in a fresh process (``python -m experiments.latency_lib.memory``) so
peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) never mixes configurations. The child
holds a stack of ``layers`` layers of Llama-8B attention at ``context``, prefilling them one after
the other (random prompt K/V, the last chunk through ``method.prefill`` so query-aware methods see
queries, then ``end_prefill``, which compacts a compression method's cache into a smaller buffer)
and decoding a few steps over all of them. A one-layer warm-up first compiles everything at the
real shapes; the kernel's RSS high-water mark is then reset (``/proc/self/clear_refs``), so the
peak counts the caches, not XLA's compiler. Peak RSS holds every layer's kept cache plus one
layer's full-size cache while it is being prefilled (a real layer-by-layer prefill has the same
transient).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys

CHUNK = 64


def _rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
  """Peak RSS since the last reset: ``VmHWM`` (what ``clear_refs`` resets), else ru_maxrss."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return _maxrss_mb()


def _maxrss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _reset_peak() -> bool:
  """Resets the kernel's RSS high-water mark (Linux >= 4.0), so the peak excludes the warm-up."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def child(spec: str, context: int, layers: int, dtype: str, hq: int, hkv: int, d: int,
          block_size: int, steps: int = 2) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top
  from sparse_attn.cache import write  # pylint: disable=g-import-not-at-top

  m = methods.make(spec, block_size=block_size)
  dt = jnp.dtype(dtype)
  cap = -(-(context + steps) // block_size) * block_size
  fill = jax.jit(write, donate_argnums=(0,))
  prefill = jax.jit(lambda q, k, v, c, s, p: m.prefill(q, k, v, c, s, p)[1:],
                    donate_argnums=(3, 4))
  step = jax.jit(lambda q, k, v, c, s, p: m.decode(q, k, v, c, s, p), donate_argnums=(3, 4))
  q1 = jnp.ones((1, hq, 1, d), dt)
  k1 = jnp.ones((1, hkv, 1, d), dt)

  def run(layers):
    caches, states = [], []
    for layer in range(layers):
      keys = jax.random.split(jax.random.key(layer), 3)
      n = context - CHUNK
      cache = m.init_cache(1, hkv, cap, d, dt)
      kk = jax.random.normal(keys[0], (1, hkv, context, d), dt)
      vv = jax.random.normal(keys[1], (1, hkv, context, d), dt)
      cache = fill(cache, kk[:, :, :n], vv[:, :, :n], jnp.arange(n, dtype=jnp.int32)[None])
      st = m.init_state(1, hq, hkv, d, cap, dt)
      q = jax.random.normal(keys[2], (1, hq, CHUNK, d), dt)
      pos = jnp.arange(n, context, dtype=jnp.int32)[None]
      cache, st = prefill(q, kk[:, :, n:], vv[:, :, n:], cache, st, pos)
      del kk, vv
      cache, st = m.end_prefill(cache, st)  # concrete lengths: sizes the compacted buffer
      jax.block_until_ready(cache)
      caches.append(cache)
      states.append(st)
    for i in range(steps):
      for layer in range(layers):
        pos = jnp.full((1, 1), context + i, jnp.int32)
        _, caches[layer], states[layer] = step(q1, k1, k1, caches[layer], states[layer], pos)
    jax.block_until_ready(caches)
    return caches

  del run(1)[:]  # warm-up: every compilation at the real shapes, then freed
  gc.collect()
  base_rss = _rss_mb()
  reset = _reset_peak()
  caches = run(layers)
  return dict(method=spec, context=context, layers=layers, dtype=dtype,
              cache_bytes=sum(c.nbytes() for c in caches),
              kv_bytes=sum(int(c.k.nbytes + c.v.nbytes) for c in caches),
              slots_per_layer=int(caches[0].capacity), peak_rss_mb=_peak_mb(),
              rss_after_mb=_rss_mb(), base_rss_mb=base_rss, peak_reset=reset,
              ru_maxrss_mb=_maxrss_mb())


def measure(s, specs: list[str]) -> list[dict]:
  """Runs ``child`` for every spec, each in a fresh interpreter (in parallel: peaks are per
  process); returns their records."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  procs = []
  for spec in specs:
    cmd = [sys.executable, "-m", "experiments.latency_lib.memory", f"--spec={spec}",
           f"--context={s.memory_context}", f"--layers={s.memory_layers}",
           f"--dtype={s.memory_dtype}", f"--hq={s.num_heads}", f"--hkv={s.num_kv_heads}",
           f"--d={s.head_dim}", f"--block_size={s.block_size}"]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=root, env=env))
  out = []
  for spec, p in zip(specs, procs):
    stdout, stderr = p.communicate()
    if p.returncode:
      raise RuntimeError(f"memory child failed for {spec}:\n{stderr[-3000:]}")
    out.append(json.loads(stdout.strip().splitlines()[-1]))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--spec", required=True)
  for name in ("context", "layers", "hq", "hkv", "d", "block_size"):
    ap.add_argument(f"--{name}", type=int, required=True)
  ap.add_argument("--dtype", default="bfloat16")
  a = ap.parse_args(argv)
  rec = child(a.spec, a.context, a.layers, a.dtype, a.hq, a.hkv, a.d, a.block_size)
  print(json.dumps(rec))


if __name__ == "__main__":
  main()
