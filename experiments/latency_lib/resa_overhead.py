"""RESA's overheads as its paper reports them (Yang et al., Tables 3-4).

Measured here: the last prefill chunk of one layer (Llama-8B attention) through ``prefill`` +
``end_prefill`` with and without RESA (the prior is formed over the whole cache in
``end_prefill``: one ``mu_Q . K`` pass and one softmax-weighted ``V`` pass), interleaved.
Derived in ``report`` from the other sections: whole-prefill overhead on SmolLM2
(``end_to_end`` prefill of ``quest+resa`` vs ``quest``) and decode overhead over the selector
alone (``per_layer`` and ``end_to_end`` decode).
"""

from __future__ import annotations

import jax.numpy as jnp

from experiments.latency_lib import per_layer, timing


def run_context(s, context: int, selector: str = "quest:gqa=group") -> list[dict]:
  dtype = jnp.dtype(s.dtypes.split(",")[0])
  chunk = min(s.resa_chunk, context // 2)
  ms = [(spec, per_layer.make_method(spec, s)) for spec in (selector, selector + "+resa")]
  b = per_layer.Bench(s, dtype, context, 8, s.seed, per_layer.cache_kinds([m for _, m in ms]))
  b.kv_numpy = None
  cands = [b.last_chunk(m, spec, chunk, s.seed + 1) for spec, m in ms]
  timing.interleaved(cands, s.warmup, s.repeats, s.max_seconds_per_context)
  base, resa = cands[0].median_s, cands[1].median_s
  return [dict(section="resa", what="last prefill chunk + end_prefill (one layer)",
               dtype=str(dtype), context=context, chunk=chunk, selector=selector,
               selector_ms=base * 1e3, resa_ms=resa * 1e3,
               overhead_pct=100.0 * (resa / base - 1.0),
               # the interleaved rounds: round i of both ran under the same load (paired)
               selector_times_ms=[t * 1e3 for t in cands[0].times],
               resa_times_ms=[t * 1e3 for t in cands[1].times])]
