r"""Registers, spills and shared memory of every Triton launch of whole decode steps, for sm_90.

  python -m experiments.ptx_steps --contexts=32768,131072 --batches=1,8 \
      --methods="dense;quest:gqa=group,p=0.1;quest:gqa=group,p=0.1+retro:w=8"

Each method's decode step (append, select, attend, enhancers) at a named attention shape
(default Llama-3.1-8B's 32 query / 8 kv heads, head dim 128, bf16 cache) is exported for CUDA
(``jax.export``, the lowering a GPU run compiles) with every op's ``impl`` resolved as on an
sm_90 GPU (``backends.assume_capability``: what a GPU run's default ``impl="auto"`` runs
there, compression methods included; a spec's own ``impl=`` still wins). A compression method's
cache is the size it decodes over (``decode_capacity``: the kept share of the context), in the
layout it decodes from (Ada-KV's flat buffer holds every kv head's share in one);
TidalDecode's step is a selection layer followed by a reuse layer, which reads its relay. Each
of the step's Pallas-Triton calls is compiled
to sm_90 by the ``triton`` package (the ``ptx`` extra; ``pallas_kernels.ptx``); ``ptxas`` then
gives its registers and spilled bytes. A spill is local-memory traffic a kernel was not designed
for: the sweep is how the window's split combine and the multi-query kernel with RESA's prior
were found spilling (docs/results.md). Specs are separated by ``;`` (a spec holds commas). No GPU
is needed; nothing here is a timing.
"""

from __future__ import annotations

import dataclasses
import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp

from pallas_kernels import backends, ptx
from sparse_attn import methods
from sparse_attn.compression import flat, layout

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so the module imports cleanly)."""
  flags.DEFINE_string("methods", "dense;quest:gqa=group,p=0.1", "Method specs, ';'-separated.")
  flags.DEFINE_string("contexts", "32768", "Cache slots, comma-separated.")
  flags.DEFINE_string("batches", "1", "Batch sizes, comma-separated.")
  flags.DEFINE_integer("num_heads", 32, "Query heads.")
  flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
  flags.DEFINE_integer("head_dim", 128, "Head dim.")


def decode_step(m):
  """``(cache, state, q, k, v, positions) -> outputs``: one decode step of method ``m`` as a
  GPU run traces it; TidalDecode's (``decode_relay``) is a selection layer, then a reuse layer
  over the same cache reading the selection it relays."""
  if not hasattr(m, "decode_relay"):
    return lambda c, s, q, k, v, p: m.decode(q, k, v, c, s, p)
  select, reuse = (dataclasses.replace(m, role=role) for role in ("select", "reuse"))

  def step(c, s, q, k, v, p):
    out, c, s, relay = select.decode_relay(q, k, v, c, s, None, p)
    out_reuse, c, s, _ = reuse.decode_relay(q, k, v, c, s, relay, p)
    return out, out_reuse, c, s
  return step


def decode_cache(m, batch: int, num_kv_heads: int, slots: int, head_dim: int, dtype):
  """The cache ``m`` decodes over: ``slots`` per kv head, per head or, for a method whose
  head budget compacts into Ada-KV's flat buffer, every head's in one ``[B, K slots, D]``."""
  cache = m.init_cache(batch, num_kv_heads, slots, head_dim, dtype)
  if getattr(getattr(m, "head_rule", None), "layout", None) is not layout.FLAT:
    return cache
  return flat.from_heads(cache.k, cache.v, cache.pos, cache.valid, num_kv_heads * slots,
                         cache.block_size)[0]


def step_launches(spec: str, context: int, batch: int, *, num_heads: int = 32,
                  num_kv_heads: int = 8, head_dim: int = 128, dtype=jnp.bfloat16,
                  capability: float = 9.0) -> list[dict]:
  """``[{name, grid, num_warps, registers, spill_bytes, shared_bytes}]`` of each Triton launch in
  ``spec``'s decode step over a ``[batch, num_kv_heads, slots, head_dim]`` cache (``slots``:
  ``context``, or the compressed cache a compression method decodes over), ops resolved as
  on a GPU of compute ``capability``."""
  m = methods.make(spec)
  w = m.window
  slots = m.decode_capacity(context, 0) if hasattr(m, "decode_capacity") else context
  cache = jax.eval_shape(lambda: decode_cache(m, batch, num_kv_heads, slots, head_dim, dtype))
  state = jax.eval_shape(lambda: m.init_state(batch, num_heads, num_kv_heads, head_dim, slots,
                                              dtype))
  kv = jax.ShapeDtypeStruct((batch, num_kv_heads, w, head_dim), dtype)
  q = jax.ShapeDtypeStruct((batch, num_heads, w, head_dim), dtype)
  positions = jax.ShapeDtypeStruct((batch, w), jnp.int32)
  out = []
  with tempfile.TemporaryDirectory() as tmp, backends.assume_capability(capability):
    for mod in ptx.triton_modules(decode_step(m), cache, state, q, kv, kv, positions):
      kernel = ptx.compile_sm90(mod, tmp)
      out.append(dict(name=mod.name, grid=mod.grid, num_warps=mod.num_warps,
                      shared_bytes=int(kernel.metadata.shared),
                      **ptx.register_usage(kernel, tmp)))
  return out


def main(argv):
  del argv
  split = lambda s, sep=",": [x for x in s.split(sep) if x]
  spilled = 0
  for spec in split(FLAGS.methods, ";"):
    for context in map(int, split(FLAGS.contexts)):
      for batch in map(int, split(FLAGS.batches)):
        for r in step_launches(spec, context, batch, num_heads=FLAGS.num_heads,
                               num_kv_heads=FLAGS.num_kv_heads, head_dim=FLAGS.head_dim):
          spilled += r["spill_bytes"] > 0
          print(f"{spec} context={context} batch={batch}: {r['name']} grid={r['grid']} "
                f"warps={r['num_warps']} registers={r['registers']} spill={r['spill_bytes']} B "
                f"smem={r['shared_bytes'] / 1024:.1f} KB"
                + ("  <- spills" if r["spill_bytes"] else ""), flush=True)
  print(f"{spilled} launch(es) spill")


if __name__ == "__main__":
  define_flags()
  app.run(main)
