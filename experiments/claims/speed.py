"""Speed and memory claims measured by ``experiments.latency`` (records of ``latency_lib``).

Per-layer records (``section="per_layer"``) hold, per (dtype, context, method), the timed rounds
``times_ms`` of one decode step of one Llama-3.1-8B-shaped attention layer; the methods run
round-robin, so round ``i`` of two methods ran under the same machine load and their per-round
ratio is a paired sample. Memory records (``section="memory"``) hold a SmolLM2 cache's bytes
and the peak RSS of a child process that prefilled and decoded with it.
"""

from __future__ import annotations

import numpy as np

from experiments.claims.overhead import overhead_verdict  # pylint: disable=unused-import (re-exported)
from experiments.claims import speed_e2e
from experiments.claims.row import Measured
from experiments.common import stats

QUEST = "quest:gqa=group"


def backend(r) -> str:
  """``"cpu"`` or ``"gpu"``: where a record was measured (from its machine header)."""
  return r.get("machine", {}).get("backend", "cpu")


def _on(records, where: str):
  return [r for r in records if backend(r) == where]


def _latest_run(records, dtype, context, methods) -> dict | None:
  """``method -> record`` of the latest run that timed every one of ``methods`` at ``(dtype,
  context)`` per layer, so a ratio pairs rounds that ran under the same load (two runs, days
  apart on different trees or devices, never pair). None when no run timed them all."""
  runs: dict = {}
  for r in records:
    if (r.get("section"), r.get("dtype"), r.get("context")) == ("per_layer", dtype, context) and (
        r.get("method") in methods):
      runs.setdefault(r.get("run"), {}).setdefault(r["method"], r)
  full = [run for run in runs.values() if all(m in run for m in methods)]
  if not full:
    return None
  return max(full, key=lambda run: max(r.get("time", "") for r in run.values()))


def _rounds_of(run: dict) -> dict:
  """``method -> rounds`` (``times_ms``) of a run's ``method -> record``."""
  return {m: np.asarray(r["times_ms"], np.float64) for m, r in run.items()}


def _run_rounds(records, dtype, context, methods) -> dict | None:
  """``method -> rounds`` of ``_latest_run``'s records."""
  run = _latest_run(records, dtype, context, methods)
  return None if run is None else _rounds_of(run)


def _devices(read: list[dict]) -> str:
  """The devices of the records a row read, in order of first appearance."""
  return ", ".join(dict.fromkeys(r.get("device", "GPU") for r in read))


def _overheads(records, method, base=QUEST, dtype="float32"):
  """Per context: (context, mean overhead, lo, hi, rounds, records read, median added
  microseconds per step) of ``method`` over ``base``, the rounds of one run (``_latest_run``)."""
  out = []
  for ctx in sorted({r["context"] for r in records if r.get("section") == "per_layer"}):
    run = _latest_run(records, dtype, ctx, (method, base))
    if run is None:
      continue
    rounds = _rounds_of(run)
    a, b = rounds[method], rounds[base]
    n = min(len(a), len(b))
    m, lo, hi = stats.paired_bootstrap(a[:n] / b[:n] - 1.0, np.zeros(n))
    added_us = 1e3 * float(np.median(a[:n] - b[:n]))
    out.append((ctx, m, lo, hi, n, list(run.values()), added_us))
  return out


def _overhead_claim(records, method, paper_max, label, *, base=QUEST, where="cpu",
                    dtype="float32"):
  rows = _overheads(_on(records, where), method, base, dtype)
  if not rows:
    return None
  worst = max(rows, key=lambda r: r[1])
  ours = "; ".join(f"{c // 1024}k {100 * m:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}] "
                   f"({us:+.0f} us)" for c, m, lo, hi, _, _, us in rows)
  read = [r for row in rows for r in row[5]]
  rounds = min(r[4] for r in rows)  # each interval is over one context's rounds
  verdict = overhead_verdict(rows, paper_max)
  if where == "cpu":
    noise = ("CPU rounds at 32k+ vary by tens of percent, so a ratio below 1 there is noise")
    device = "CPU"
  else:
    noise = ("device-looped steps (dispatch excluded); per-op profile: PROFILE.md beside the "
             "records")
    device = _devices(read) + ", Pallas kernels"
  return Measured(
      ours=ours, n=rounds,
      setting=f"one Llama-3.1-8B attention layer (32 q / 8 kv heads, d=128), {dtype}, "
              f"batch 1, {base} vs {method}, {device}",
      verdict=verdict,
      why=f"{label}; worst {100 * worst[1]:+.1f}% at {worst[0] // 1024}k; per context, "
          f"a 95% interval over its >= {rounds} paired rounds (interleaved); {noise}",
      read=read)


def resa_decode_overhead(records):
  """RESA Table 4: the Online Aggregator adds <= 3.13% to a decode step (Llama-3.1-8B, budget
  500). Ours: per-layer step time of Quest (group-shared) with and without RESA at the same
  selection; verdict by ``overhead_verdict`` with the limit 3.13%."""
  return _overhead_claim(records, f"{QUEST}+resa", 0.0313, "RESA adds one merge per step")


def resa_decode_overhead_gpu(records):
  """RESA Table 4 on a GPU, at its fixed KV budget of 500 tokens (bfloat16, Pallas kernels);
  verdict as ``resa_decode_overhead``."""
  base = f"{QUEST},budget=500"
  return _overhead_claim(records, base + "+resa", 0.0313,
                         "the RESA kernel reads the prior's selected logits and the aggregator "
                         "adds small fusions; the paper's 3.13% is of a 1.9-4.3 ms layer "
                         "(RESA Table 4), i.e. 59-135 us added", base=base, where="gpu",
                         dtype="bfloat16")


def retro_throughput_loss(records):
  """Retro Sec. 5 / Table 6: decode throughput falls by <= 7.3% (w = 8, the worst case).
  Ours: the per-layer attention step with w = 8 against the plain selector (our step
  includes re-embedding the window's K/V, not the linear layers the paper also counts). The
  paper times a whole model at batch 8 (2.8-5.1% at batch 1); one attention layer is an upper
  bound of that, so the verdict is "not comparable" until an end-to-end row exists."""
  return _not_comparable(_overhead_claim(records, f"{QUEST}+retro:w=8", 0.073,
                                         "attention of 8 queries per step instead of 1"))


def _not_comparable(got):
  """A Retro Table 6 row: the measured loss stays, the verdict waits for an end-to-end row."""
  if got is None:
    return None
  return got.plus(why="; the paper's loss is of a whole model's step at batch 8, ours of one "
                      "attention layer (an upper bound): not comparable until an end-to-end row",
                  verdict="not comparable")


def retro_throughput_loss_gpu(records):
  """Retro Table 6 on a GPU: the whole model's decode as the paper measured it
  (``speed_e2e.retro_table6``) once those records exist; until then the attention layer alone
  (bfloat16, Pallas kernels), an upper bound of the end-to-end loss and "not comparable"."""
  whole = speed_e2e.retro_table6(_on(records, "gpu"))
  if whole is not None:
    return whole
  return _not_comparable(_overhead_claim(
      records, f"{QUEST}+retro:w=8", 0.073,
      "attention of 8 queries per step instead of 1 (attention alone)", where="gpu",
      dtype="bfloat16"))


def resa_prefill_overhead(records, where="cpu"):
  """RESA Table 3: forming the prior adds 4.8-7.4% to the last prefill chunk (1024 tokens,
  8k-128k). Ours: the last chunk + ``end_prefill`` of one layer with and without RESA, per
  context the mean per-round ratio with its 95% interval over that context's interleaved
  rounds (records before rounds were stored give the ratio of medians, no interval);
  verdict by ``overhead_verdict`` with the limit 7.35% (the paper's upper end)."""
  rows = sorted((r for r in _on(records, where) if r.get("section") == "resa"),
                key=lambda r: r["context"])
  if not rows:
    return None
  per = [_prefill_overhead(r) for r in rows]  # (context, mean, lo, hi, rounds)
  verdict = overhead_verdict(per, 0.0735)
  ours = "; ".join(f"{c // 1024}k {100 * m:+.1f}%" + (f" [{100 * lo:+.1f}, {100 * hi:+.1f}]"
                                                      if np.isfinite(lo) else "")
                   for c, m, lo, hi, _ in per)
  rounds = min(p[4] for p in per)
  return Measured(
      ours=ours, n=rounds,
      setting=f"one Llama-3.1-8B attention layer, last {rows[0]['chunk']}-token chunk + "
              f"end_prefill, {rows[0]['dtype']}, {rows[0]['selector']}, {where.upper()}",
      verdict=verdict,
      why=(f"per context, a 95% interval over its {rounds} paired rounds" if rounds > 1
           else "ratio of medians (no rounds recorded: no interval; rerun latency)")
          + "; the prior's two passes over the cache are separate XLA dots (mu_Q K^T "
            "and p V), not fused into the chunk's attention")


def _prefill_overhead(r) -> tuple:
  """``(context, mean overhead, lo, hi, rounds)`` of one RESA prefill record: paired rounds
  when stored, else the ratio of medians with no interval (``rounds`` 1)."""
  a, b = r.get("resa_times_ms"), r.get("selector_times_ms")
  if a and b and min(len(a), len(b)) > 1:
    n = min(len(a), len(b))
    ratio = np.asarray(a[:n], np.float64) / np.asarray(b[:n], np.float64) - 1.0
    m, lo, hi = stats.paired_bootstrap(ratio, np.zeros(n))
    return r["context"], m, lo, hi, n
  return r["context"], r["overhead_pct"] / 100, float("nan"), float("nan"), 1


def resa_prefill_overhead_gpu(records):
  return resa_prefill_overhead(records, where="gpu")


def rectified_memory_access(records, context=None, where="cpu", dtype="float32"):
  """ReSA Sec. 2.3: memory access per step relative to dense is ``1/b + p + 1/f`` (b = 16,
  p = 0.1, f = 32: 0.194). Ours: measured per-layer step time of ``+rect:f=32`` over dense
  (rectification amortised as the benchmark runs it) at the longest context; reproduced when
  within 1.5x the model, partly within 3x (a step is not purely memory-bound)."""
  records = _on(records, where)
  rows = [r for r in records if r.get("section") == "per_layer" and r.get("dtype") == dtype
          and r.get("method") == f"{QUEST}+rect:f=32"]
  if not rows:
    return None
  r = max(rows, key=lambda r: r["context"]) if context is None else next(
      (x for x in rows if x["context"] == context), None)
  got = _run_rounds([x for x in records if x.get("run") == r.get("run")], dtype, r["context"],
                    (r["method"], "dense"))
  if got is None:
    return None
  mine, dense = got[r["method"]], got["dense"]
  n = min(len(mine), len(dense))
  m, lo, hi = stats.paired_bootstrap(mine[:n] / dense[:n], np.zeros(n))
  model = 1 / 16 + r.get("p_eff", 0.1) + 1 / 32
  verdict = ("reproduced" if m <= 1.5 * model else "partly" if m <= 3 * model
             else "not reproduced")
  device = "CPU" if where == "cpu" else f"{r.get('device', 'GPU')}, Pallas kernels"
  return Measured(ours=f"{m:.3f} [{lo:.3f}, {hi:.3f}] of dense (model {model:.3f})", n=n,
                  setting=f"one Llama-3.1-8B attention layer, {r['context'] // 1024}k, {dtype}, "
                          f"p_eff {r.get('p_eff', 0.1):.3f}, {device}",
                  verdict=verdict, why="measured step time over dense's, paired per round of "
                                       "the run that timed both")


def rectified_memory_access_gpu(records):
  """``rectified_memory_access`` on a GPU (bfloat16, Pallas kernels, dense = chunk_attention)."""
  return rectified_memory_access(records, where="gpu", dtype="bfloat16")


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
  return Measured(ours=f"cache {ratio:.3f}x dense ({ea['cache_bytes'] / 2**20:.0f} vs "
                       f"{dense['cache_bytes'] / 2**20:.0f} MB); peak-RSS growth {growth:.2f}x",
                  n=1, setting=f"Llama-3.1-8B-shaped KV cache ({ea['layers']} layers), "
                               f"{ea['context']} tokens, {ea.get('dtype', '')}, {ea['method']}",
                  verdict=verdict, why="bytes of the compacted cache; RSS includes activations")


def _band(x, ok, part) -> str:
  if ok[0] <= x <= ok[1]:
    return "reproduced"
  return "partly" if part[0] <= x <= part[1] else "not reproduced"
