"""Random problems shared by the sparse_attn tests (fresh normal data, never zeros), and a spy
on the Pallas kernels a call traces."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparse_attn import cache as cache_lib
from sparse_attn import selectors

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def tol(dtype):
  return TOL[jnp.dtype(dtype).type]


def normal(rng, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def filled_cache(rng, b, hkv, t, d, lengths, block_size=16, dtype=jnp.float32, scale=1.0):
  """A cache with ``lengths[i]`` random keys/values written in row i (appended in one write)."""
  c = cache_lib.init_cache(b, hkv, t, d, block_size, dtype)
  s = max(max(lengths), 1)
  pos = np.full((b, s), -1, np.int32)
  for i, n in enumerate(lengths):
    pos[i, :n] = np.arange(n)
  k = normal(rng, (b, hkv, s, d), dtype, scale)
  v = normal(rng, (b, hkv, s, d), dtype)
  return cache_lib.write(c, k, v, jnp.asarray(pos))


def select(name, q, cache, budget, **options):
  """The selection of selector ``name`` (its options: gqa, variant, ...) on the jnp path."""
  sel = selectors.SELECTORS[name](budget=budget, block_size=cache.block_size, **options)
  return sel.select(q, cache, impl="xla")


def prefill_then_decode(m, rng, lengths, *, capacity, head_dim, steps, dtype=jnp.float32,
                        scale=1.0, b=2, hq=4, hkv=2, jit=False):
  """Method ``m`` on random prompts of ``lengths`` (0 = a padding row): prefill, end_prefill,
  then ``steps`` one-token decode steps (``jit``: one compiled step) ->
  ``(outs, cache after the prompt, cache after the steps)``; queries and keys scaled by
  ``scale``."""
  import jax  # pylint: disable=import-outside-toplevel
  d, s = head_dim, max(lengths)
  cache = m.init_cache(b, hkv, capacity, d, dtype)
  state = m.init_state(b, hq, hkv, d, capacity, dtype)
  pos = np.full((b, s), -1, np.int32)
  for i, n in enumerate(lengths):
    pos[i, :n] = np.arange(n)
  q = normal(rng, (b, hq, s, d), dtype, scale)
  k = normal(rng, (b, hkv, s, d), dtype, scale)
  v = normal(rng, (b, hkv, s, d), dtype)
  _, cache, state = m.prefill(q, k, v, cache, state, jnp.asarray(pos))
  cache, state = m.end_prefill(cache, state)
  prompt_cache, outs, step = cache, [], jax.jit(m.decode) if jit else m.decode
  for t in range(steps):
    p = jnp.asarray([[n + t if n else -1] for n in lengths], jnp.int32)
    q1, k1, v1 = (normal(rng, (b, h, 1, d), dtype, scale if x != 2 else 1.0)
                  for x, h in enumerate((hq, hkv, hkv)))
    out, cache, state = step(q1, k1, v1, cache, state, p)
    outs.append(out)
  return outs, prompt_cache, cache


def traced_kernels(monkeypatch) -> list[tuple[str, int | None]]:
  """``(kernel, entry size)`` of each Pallas decode, chunk or append kernel traced from now on
  (the jit caches are cleared first, so nothing traced before is reused): ``("decode",
  block_size)`` for the split-K decode kernels, ``("chunk", None)`` for ``chunk_attention``'s,
  ``("append", None)`` for ``cache_append``'s."""
  jax.clear_caches()
  seen = []

  def spy(module: str, attr: str, tag):
    real = getattr(sys.modules[f"pallas_kernels.{module}"], attr)

    def traced(*args, **kw):
      seen.append(tag(kw))
      return real(*args, **kw)
    monkeypatch.setattr(sys.modules[f"pallas_kernels.{module}"], attr, traced)
  for name in ("_decode_kernel", "sparse_decode", "sparse_decode_resa",
               "sparse_decode_multiquery", "flat_decode"):
    spy(name, "decode_partials", lambda kw: ("decode", kw["block_size"]))
  spy("chunk_attention", "_chunk_attention_kernel", lambda kw: ("chunk", None))
  spy("cache_append", "_append_kernel", lambda kw: ("append", None))
  return seen
