"""One layer's dense prefill chunk: ``chunk_attention``'s Pallas kernel vs its in-order branch.

A prefill chunk of ``prefill_chunk`` queries (the last one of a ``context``-token prompt, and
the first, from an empty cache) over the same in-order bf16 cache, the heads of the per-layer
shape: the kernel alone (``in_order=None``) next to the path a GPU takes by default
(``in_order="auto"``: cuDNN's flash attention through ``jax.nn.dot_product_attention``; on a
CPU ``"xla"`` stands in, so the quick run exercises the branch), timed round-robin in one run.
Each record carries its ratio to the kernel and the attention FLOP rate, so the choice of the
default is measured, not assumed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.latency_lib import timing
from pallas_kernels import chunk_attention
from pallas_kernels.chunk_attention import in_order_implementation

KERNEL = "chunk kernel"


def _flops(queries: int, keys_before: int, num_heads: int, head_dim: int) -> float:
  """Attention FLOPs of a causal chunk (QK^T and PV, 2 each per pair seen)."""
  pairs = queries * keys_before + queries * (queries + 1) / 2
  return 4.0 * pairs * num_heads * head_dim


def run_context(s, dtype: str, context: int, chunk: int) -> list[dict]:
  """Times the first and the last ``chunk`` of a ``context``-token prompt both ways."""
  hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
  dt = jnp.dtype(dtype)
  keys = jax.random.split(jax.random.key(s.seed), 3)
  k = jax.random.normal(keys[0], (1, hkv, context, d), dt)
  v = jax.random.normal(keys[1], (1, hkv, context, d), dt)
  q = jax.random.normal(keys[2], (1, hq, chunk, d), dt)
  k_pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (1, hkv, context))
  length = jnp.array([context], jnp.int32)
  library = in_order_implementation("auto", dt, chunk, d, None) or "xla"
  rows = []
  for where, start in (("last", context - chunk), ("first", 0)):
    pos = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
    filled = jnp.array([start + chunk], jnp.int32) if start == 0 else length
    cands = []
    for name, in_order in ((KERNEL, None), (f"in-order ({library})", library)):
      fn = jax.jit(lambda q, k, v, p, kp, n, o=in_order: chunk_attention(
          q, k, v, p, kp, n, impl="pallas", in_order=o, interpret=jax.default_backend() != "gpu"))
      cands.append(timing.Candidate(name, lambda f=fn, p=pos, n=filled: f(q, k, v, p, k_pos, n)))
    timing.interleaved(cands, s.warmup, s.repeats, s.max_seconds_per_context)
    base = cands[0].median_s
    flops = _flops(chunk, start, hq, d)
    for c in cands:
      rows.append(dict(section="prefill_chunk", dtype=dtype, context=context, chunk=chunk,
                       where=where, method=c.name, ms=c.median_s * 1e3,
                       vs_kernel=c.median_s / base, tflops=flops / c.median_s / 1e12,
                       compile_s=c.first_s))
  return rows
