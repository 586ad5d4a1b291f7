r"""Decode over Ada-KV's flat buffer: the kernel next to the jnp form it replaces and a per-head
cache of the same kept share.

  python -m experiments.flat_decode_bench --contexts=32768,131072 --keep=0.5 \
      --out=/tmp/flat_decode.jsonl

One Llama-3.1-8B attention layer (32 q / 8 kv heads, d = 128, ``--dtype`` cache, ``--batch``),
a prompt of ``context`` tokens compressed to ``keep`` of them. Ada-KV gives the kv heads
different shares (here drawn once from a Dirichlet(1) over the heads, at least one token each)
and stores them in one flat buffer of ``keep * context * K`` slots (``compression.flat``); a
uniform budget stores ``keep * context`` slots per head. Timed, interleaved round by round
(``latency_lib.timing``; each call loops ``--steps`` steps on the device, each step's output the
next step's query):

* ``flat kernel``: ``pallas_kernels.flat_decode`` (the split-K kernel over single slots, every
  query head a row of one program head), what ``layout.Flat`` runs on a GPU;
* ``flat jnp``: ``compression.flat.attend``, the jnp form it replaced (every query head's masked
  softmax over the whole buffer);
* ``per-head kernel``: ``kernels.dense_decode`` over the uniform per-head cache (the same bytes
  of K and V).

Each row: microseconds a step (median over rounds), the bytes of K and V it must read over the
peak bandwidth (``--peak_tbs``; ``bound_us``) as a fraction, the paired per-round ratio of
``flat jnp`` and ``per-head kernel`` over ``flat kernel``, and ``max_abs_diff``, one step's
largest output difference between the kernel and the jnp form (checked before timing).
``--interpret`` runs the kernels in Pallas interpret mode (a CPU rehearsal; its times mean
nothing).
"""

from __future__ import annotations

import json
import statistics

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import results
from experiments.latency_lib import timing
import pallas_kernels
from sparse_attn import cache as cache_lib
from sparse_attn import kernels
from sparse_attn.compression import flat

FLAGS = flags.FLAGS
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def define_flags():
  """The command line (defined only when run as a script, so the module imports cleanly)."""
  flags.DEFINE_string("contexts", "32768,131072", "Prompt tokens, comma-separated.")
  flags.DEFINE_float("keep", 0.5, "Kept share of the prompt.")
  flags.DEFINE_integer("batch", 1, "Batch rows.")
  flags.DEFINE_string("dtype", "bfloat16", "Cache dtype.")
  flags.DEFINE_integer("steps", 32, "Decode steps per timed call, looped on the device.")
  flags.DEFINE_integer("repeats", 9, "Interleaved rounds.")
  flags.DEFINE_float("peak_tbs", 3.35, "Peak HBM bandwidth, TB/s (H100 SXM 3.35, H200 4.8).")
  flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU rehearsal, no timing).")
  flags.DEFINE_string("out", "", "JSON-lines file for the rows (appended).")


def head_counts(kept: int, kv_heads: int, seed: int = 0) -> np.ndarray:
  """``[K]`` tokens each kv head keeps, summing to ``kv_heads * kept`` (Dirichlet(1) shares,
  at least one token a head)."""
  total = kv_heads * kept
  share = np.random.default_rng(seed).dirichlet(np.ones(kv_heads))
  counts = np.maximum(1, np.floor(share * (total - kv_heads)).astype(int) + 1)
  counts[np.argmax(counts)] += total - counts.sum()
  return counts


def flat_cache(batch: int, counts: np.ndarray, dtype, seed: int = 0) -> flat.FlatKVCache:
  """A compacted flat buffer: head ``h``'s ``counts[h]`` tokens contiguous, in token order."""
  total = int(counts.sum())
  cap = -(-total // 16) * 16
  key_k, key_v = jax.random.split(jax.random.PRNGKey(seed))
  head = np.repeat(np.arange(len(counts)), counts)
  pos = np.concatenate([np.sort(np.random.default_rng(seed + h).choice(
      max(counts) * 2, c, replace=False)) for h, c in enumerate(counts)])
  pad = lambda x, fill: np.pad(x, (0, cap - total), constant_values=fill)
  rows = lambda x: jnp.asarray(np.broadcast_to(x, (batch, cap)))
  return flat.FlatKVCache(
      k=jax.random.normal(key_k, (batch, cap, HEAD_DIM), dtype),
      v=jax.random.normal(key_v, (batch, cap, HEAD_DIM), dtype),
      pos=rows(pad(pos, -1)).astype(jnp.int32),
      head=rows(pad(head, 0)).astype(flat.head_dtype(len(counts))),
      length=jnp.full((batch,), total, jnp.int32), num_kv_heads=len(counts), block_size=16)


def per_head_cache(batch: int, kept: int, dtype, seed: int = 1) -> cache_lib.KVCache:
  """A uniform budget's per-head cache holding ``kept`` tokens a head."""
  cap = -(-kept // 16) * 16
  c = cache_lib.init_cache(batch, KV_HEADS, cap, HEAD_DIM, 16, dtype, ())
  key_k, key_v = jax.random.split(jax.random.PRNGKey(seed))
  shape = (batch, KV_HEADS, kept, HEAD_DIM)
  slots = jnp.broadcast_to(jnp.arange(kept, dtype=jnp.int32), (batch, kept))
  return cache_lib.write(c, jax.random.normal(key_k, shape, dtype),
                         jax.random.normal(key_v, shape, dtype), slots)


def looped(attend, cache, q, steps: int):
  """``() -> out``: ``steps`` decode steps of ``attend(q, cache) -> [B, N, D]`` in one device
  loop, each step's output the next step's query."""
  run = jax.jit(lambda q, c: jax.lax.fori_loop(0, steps, lambda _, q: attend(q, c), q))
  return lambda: run(q, cache)


def candidates(batch: int, context: int, keep: float, dtype, steps: int, interpret: bool):
  """The three timed decode loops of one context, the bytes of K and V each step reads and the
  largest difference of one step's output between the kernel and the jnp form."""
  kept = max(1, int(keep * context))
  fc = flat_cache(batch, head_counts(kept, KV_HEADS), dtype)
  pc = per_head_cache(batch, kept, dtype)
  q = jax.random.normal(jax.random.PRNGKey(2), (batch, HEADS, HEAD_DIM), dtype)
  at = jnp.full((batch,), 4 * context, jnp.int32)  # after every kept token
  impl = dict(impl="pallas", interpret=interpret)
  kernel = lambda q, c: pallas_kernels.flat_decode(
      q, c.k, c.v, c.head, c.length, num_kv_heads=KV_HEADS, pos=c.pos, query_pos=at, **impl)[0]
  jnp_form = lambda q, c: flat.attend(q[:, :, None], c, at[:, None])[0][:, :, 0]
  per_head = lambda q, c: kernels.dense_decode(q, c, at, **impl)[0]
  gap = float(jnp.max(jnp.abs(kernel(q, fc).astype(jnp.float32)
                              - jnp_form(q, fc).astype(jnp.float32))))
  cands = [timing.Candidate("flat kernel", looped(kernel, fc, q, steps), per_call=steps),
           timing.Candidate("flat jnp", looped(jnp_form, fc, q, steps), per_call=steps),
           timing.Candidate("per-head kernel", looped(per_head, pc, q, steps), per_call=steps)]
  moved = 2 * batch * KV_HEADS * kept * HEAD_DIM * jnp.dtype(dtype).itemsize
  return cands, moved, gap


def rows(cands, moved: int, gap: float, *, peak_tbs: float, **setting) -> list[dict]:
  """One record per timed candidate (``setting``: the run's context, keep, batch, ...): its
  median, its bound fraction and its per-round ratio to the kernel's (``gap``: the largest
  difference of one step's output, kernel vs jnp form)."""
  base = cands[0].times
  bound_us = moved / (peak_tbs * 1e12) * 1e6
  out = []
  for c in cands:
    us = c.median_s * 1e6
    out.append(dict(
        section="flat_decode", candidate=c.name, **setting, us_per_step=us, first_s=c.first_s,
        rounds=len(c.times), bytes=moved, bound_us=bound_us, peak_fraction=bound_us / us,
        peak_tbs=peak_tbs, max_abs_diff=gap,
        over_flat_kernel=statistics.median(t / b for t, b in zip(c.times, base)),
        git=results.git_revision(), device=jax.devices()[0].device_kind, jax=jax.__version__))
  return out


def main(argv):
  del argv
  dtype = jnp.dtype(FLAGS.dtype)
  for context in (int(x) for x in FLAGS.contexts.split(",") if x):
    cands, moved, gap = candidates(FLAGS.batch, context, FLAGS.keep, dtype, FLAGS.steps,
                                   FLAGS.interpret)
    timing.interleaved(cands, warmup=1, repeats=FLAGS.repeats)
    got = rows(cands, moved, gap, peak_tbs=FLAGS.peak_tbs, context=context, keep=FLAGS.keep,
               batch=FLAGS.batch, dtype=FLAGS.dtype, steps=FLAGS.steps, interpret=FLAGS.interpret)
    print("\n".join(f"{context} keep {FLAGS.keep} batch {FLAGS.batch}: {r['candidate']}: "
                    f"{r['us_per_step']:.1f} us/step ({100 * r['peak_fraction']:.0f}% of peak), "
                    f"{r['over_flat_kernel']:.2f}x the flat kernel" for r in got), flush=True)
    if FLAGS.out:  # each context's rows as soon as they are measured
      with open(FLAGS.out, "a", encoding="utf-8") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in got)


if __name__ == "__main__":
  define_flags()
  app.run(main)
