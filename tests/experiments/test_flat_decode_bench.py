"""experiments.flat_decode_bench on a CPU (interpret mode, a tiny context): Ada-KV-like head
shares that fill the buffer exactly, the kernel's step equal to the jnp form's before timing, and
one record per candidate with its ratio to the kernel paired by round."""

import jax.numpy as jnp
import numpy as np

from experiments import flat_decode_bench as bench
from experiments.latency_lib import timing


def test_head_counts_share_the_layer_total():
  counts = bench.head_counts(100, 8)
  assert counts.sum() == 800 and counts.min() >= 1 and len(set(counts)) > 1


def test_rehearsal_records_each_candidate():
  cands, moved, gap = bench.candidates(1, 128, 0.5, jnp.float32, 1, interpret=True)
  assert gap < 1e-4  # the kernel's step is the jnp form's
  assert moved == 2 * 8 * 64 * 128 * 4
  timing.interleaved(cands, warmup=0, repeats=2)
  rows = bench.rows(cands, moved, gap, peak_tbs=3.35, context=128, keep=0.5)
  assert [r["candidate"] for r in rows] == ["flat kernel", "flat jnp", "per-head kernel"]
  assert rows[0]["over_flat_kernel"] == 1.0 and rows[0]["context"] == 128
  assert all(r["rounds"] == 2 and np.isfinite(r["us_per_step"]) for r in rows)
