"""Speed and memory claims measured by ``experiments.latency`` (records of ``latency_lib``).

Per-layer records (``section="per_layer"``) hold, per (dtype, context, method), the timed rounds
``times_ms`` of one decode step of one Llama-3.1-8B-shaped attention layer; the methods run
round-robin, so round ``i`` of two methods ran under the same machine load and their per-round
ratio is a paired sample. Memory records (``section="memory"``) hold a SmolLM2 cache's bytes
and the peak RSS of a child process that prefilled and decoded with it.
"""

from __future__ import annotations

import numpy as np

from experiments.common import stats

QUEST = "quest:gqa=group"


def _rounds(records, dtype, context, method):
  for r in records:
    if (r.get("section"), r.get("dtype"), r.get("context"), r.get("method")) == (
        "per_layer", dtype, context, method):
      return np.asarray(r["times_ms"], np.float64)
  return None


def _overheads(records, method, base=QUEST, dtype="float32"):
  """Per context: (context, mean overhead, lo, hi, rounds) of ``method`` over ``base``."""
  out = []
  for ctx in sorted({r["context"] for r in records if r.get("section") == "per_layer"}):
    a, b = _rounds(records, dtype, ctx, method), _rounds(records, dtype, ctx, base)
    if a is None or b is None:
      continue
    n = min(len(a), len(b))
    ratio = a[:n] / b[:n] - 1.0
    m, lo, hi = stats.paired_bootstrap(ratio, np.zeros(n))
    out.append((ctx, m, lo, hi, n))
  return out


def _overhead_claim(records, method, paper_max, label):
  rows = _overheads(records, method)
  if not rows:
    return None
  worst = max(rows, key=lambda r: r[1])
  ours = "; ".join(f"{c // 1024}k {100 * m:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"
                   for c, m, lo, hi, _ in rows)
  verdict = ("reproduced" if worst[1] <= paper_max or worst[2] <= paper_max else
             "partly" if worst[1] <= 2 * paper_max else "not reproduced")
  return dict(ours=ours, n=sum(r[4] for r in rows),
              setting=f"one Llama-3.1-8B attention layer (32 q / 8 kv heads, d=128), float32, "
                      f"batch 1, {QUEST} vs {method}, CPU",
              verdict=verdict,
              why=f"{label}; worst {100 * worst[1]:+.1f}% at {worst[0] // 1024}k; per-round paired "
                  "ratios (rounds interleaved); CPU rounds at 32k+ vary by tens of percent, so a "
                  "ratio below 1 there is noise")


def resa_decode_overhead(records):
  """RESA Table 4: the Online Aggregator adds <= 3.13% to a decode step (Llama-3.1-8B, budget
  500). Ours: per-layer step time of Quest (group-shared) with and without RESA at the same
  selection; reproduced when the worst context's overhead (or its lower bound) is <= 3.13%,
  partly when <= 6.26%."""
  return _overhead_claim(records, f"{QUEST}+resa", 0.0313, "RESA adds one merge per step")


def retro_throughput_loss(records):
  """Retro Sec. 5 / Table 6: decode throughput falls by <= 7.3% (w = 8, the worst case).
  Ours: the per-layer attention step with w = 8 against the plain selector (our step
  includes re-embedding the window's K/V, not the linear layers the paper also counts);
  reproduced when <= 7.3%, partly when <= 14.6%."""
  return _overhead_claim(records, f"{QUEST}+retro:w=8", 0.073,
                         "attention of 8 queries per step instead of 1")


def rectified_memory_access(records, context=None):
  """ReSA Sec. 2.3: memory access per step relative to dense is ``1/b + p + 1/f`` (b = 16,
  p = 0.1, f = 32: 0.194). Ours: measured per-layer step time of ``+rect:f=32`` over dense
  (rectification amortised as the benchmark runs it) at the longest context; reproduced when
  within 1.5x the model, partly within 3x (a CPU step is not purely memory-bound)."""
  rows = [r for r in records if r.get("section") == "per_layer" and r.get("dtype") == "float32"
          and r.get("method") == f"{QUEST}+rect:f=32"]
  if not rows:
    return None
  r = max(rows, key=lambda r: r["context"]) if context is None else next(
      (x for x in rows if x["context"] == context), None)
  dense = _rounds(records, "float32", r["context"], "dense")
  if dense is None:
    return None
  mine = np.asarray(r["times_ms"], np.float64)
  n = min(len(mine), len(dense))
  m, lo, hi = stats.paired_bootstrap(mine[:n] / dense[:n], np.zeros(n))
  model = 1 / 16 + r.get("p_eff", 0.1) + 1 / 32
  verdict = ("reproduced" if m <= 1.5 * model else "partly" if m <= 3 * model
             else "not reproduced")
  return dict(ours=f"{m:.3f} [{lo:.3f}, {hi:.3f}] of dense (model {model:.3f})", n=n,
              setting=f"one Llama-3.1-8B attention layer, {r['context'] // 1024}k, float32, "
                      f"p_eff {r.get('p_eff', 0.1):.3f}, CPU",
              verdict=verdict, why="measured step time over dense's, paired per round")


def ea_memory(records):
  """EA Fig. 5a / Sec. 4.3: 50% compression halves the KV cache (2x reduction) and the saving
  grows with the context. Ours: cache bytes of Expected Attention at ratio 0.5 over dense's,
  and the peak RSS growth of the child process; reproduced when the cache ratio is within
  0.45-0.6, partly within 0.6-0.8."""
  rows = [r for r in records if r.get("section") == "memory"]
  dense = next((r for r in rows if r["method"] == "dense"), None)
  ea = next((r for r in rows if r["method"].startswith("expected_attention")), None)
  if dense is None or ea is None:
    return None
  ratio = ea["cache_bytes"] / dense["cache_bytes"]
  growth = (ea["peak_rss_mb"] - ea["base_rss_mb"]) / max(
      dense["peak_rss_mb"] - dense["base_rss_mb"], 1e-9)
  verdict = _band(ratio, (0.45, 0.6), (0.6, 0.8))
  return dict(ours=f"cache {ratio:.3f}x dense ({ea['cache_bytes'] / 2**20:.0f} vs "
                   f"{dense['cache_bytes'] / 2**20:.0f} MB); peak-RSS growth {growth:.2f}x",
              n=1, setting=f"Llama-3.1-8B-shaped KV cache ({ea['layers']} layers), "
                           f"{ea['context']} tokens, {ea.get('dtype', '')}, {ea['method']}",
              verdict=verdict, why="bytes of the compacted cache; RSS includes activations")


def _band(x, ok, part) -> str:
  if ok[0] <= x <= ok[1]:
    return "reproduced"
  return "partly" if part[0] <= x <= part[1] else "not reproduced"
