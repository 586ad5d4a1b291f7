"""The sweep, speed and generation claim measures on synthetic records: each rule can fail."""

import numpy as np

from experiments.claims import generation as claims_generation
from experiments.claims import speed as claims_speed
from experiments.claims import sweeps as claims_sweeps


def _lam(task, lam, scores, form="renormalised"):
  return [dict(experiment="resa_lambda", config=dict(model="m", method="resa-quest",
                                                     budget=0.025),
               task=task, length=2048, seed=i, depth=0.5, lam=lam,
               lam_form=None if lam is None else form, score=float(s))
          for i, s in enumerate(scores)]


def test_lambda_claims_pair_lambda_one_with_zero_and_with_the_best_below():
  rng = np.random.default_rng(0)
  base = (rng.random(60) < 0.4).astype(float)
  better = np.maximum(base, rng.random(60) < 0.5)
  recs = _lam("niah_multikey_2", 0.0, base) + _lam("niah_multikey_2", 1.0, better)
  got = claims_sweeps.lambda_retrieval_gain(recs)
  assert got.verdict == "reproduced" and got.n == 60
  flat = _lam("niah_multikey_2", 0.0, base) + _lam("niah_multikey_2", 1.0, base)
  assert claims_sweeps.lambda_retrieval_gain(flat).verdict == "not reproduced"
  # the literal form is another curve: not paired with the renormalised one
  assert claims_sweeps.lambda_retrieval_gain(
      _lam("niah_multikey_2", 0.0, base) + _lam("niah_multikey_2", 1.0, better, "literal")) is None
  cwe = _lam("cwe", 0.5, better) + _lam("cwe", 0.0, base) + _lam("cwe", 1.0, base * 0)
  got = claims_sweeps.lambda_aggregation_drop(cwe)
  assert got.verdict == "reproduced" and got.ours.startswith("lambda=0.5")
  # below the after-the-fact best lambda only (lambda = 0, chosen before, is no better)
  picked = _lam("cwe", 0.5, better) + _lam("cwe", 0.0, base * 0) + _lam("cwe", 1.0, base * 0)
  assert claims_sweeps.lambda_aggregation_drop(picked).verdict == "inconclusive"
  assert claims_sweeps.lambda_aggregation_drop(
      _lam("cwe", 0.5, base) + _lam("cwe", 1.0, better)).verdict == "not reproduced"
  # drops from lambda = 0 on, never rising first: half the claimed shape
  falls = _lam("cwe", 0.0, better) + _lam("cwe", 0.5, base) + _lam("cwe", 1.0, base * 0)
  got = claims_sweeps.lambda_aggregation_drop(falls)
  assert got.verdict == "partly" and "no rise" in got.why
  # records without RULER's generator field: the row says it reads the earlier variant
  assert "reads 180 records of the earlier RULER variant" in got.why
  aligned = [dict(r, generator="nvidia-ruler") for r in falls]
  assert "earlier RULER variant" not in claims_sweeps.lambda_aggregation_drop(aligned).why


def test_lambda_claims_without_headroom_are_inconclusive():
  """Where dense does not score above the lambda arms (the model cannot do the task), the
  curve is floor noise: no verdict either way; with dense above them the rules stand."""
  rng = np.random.default_rng(1)
  base = (rng.random(60) < 0.4).astype(float)
  better = np.maximum(base, rng.random(60) < 0.5)
  falls = _lam("cwe", 0.0, better) + _lam("cwe", 0.5, base) + _lam("cwe", 1.0, base * 0)
  for dense, verdict in ((np.ones(60), "partly"), (better, "inconclusive"),
                         (base * 0, "inconclusive")):
    got = claims_sweeps.lambda_aggregation_drop(falls + _lam("cwe", None, dense))
    assert got.verdict == verdict
    assert ("no headroom" in got.why) == (verdict == "inconclusive")
  # the FWE row reads fwe's records under the same rules, not cwe's
  fwe = [dict(r, task="fwe") for r in falls + _lam("cwe", None, np.ones(60))]
  assert claims_sweeps.lambda_aggregation_drop_fwe(falls) is None
  assert claims_sweeps.lambda_aggregation_drop_fwe(fwe).verdict == "partly"
  assert "fwe" in claims_sweeps.lambda_aggregation_drop_fwe(fwe).setting
  rises = _lam("niah_multikey_2", 0.0, base) + _lam("niah_multikey_2", 1.0, better)
  for dense, verdict in ((np.ones(60), "reproduced"), (better, "inconclusive")):
    got = claims_sweeps.lambda_retrieval_gain(rises + _lam("niah_multikey_2", None, dense))
    assert got.verdict == verdict
    assert ("no headroom" in got.why) == (verdict == "inconclusive")


def _budget(family, knob, resa, measured, acc, n=50):
  return [dict(experiment="budget_reduction", config=dict(model="m", tolerance=0.02,
                                                          tasks=["niah"]),
               family=family, knob=knob, resa=resa, measured_budget=measured, task="niah",
               length=2048, seed=i, depth=0.5, score=float(i < acc * n)) for i in range(n)]


def test_budget_reduction_finds_the_smallest_budget_within_tolerance():
  recs = _budget("dense", 0.0, False, 1.0, 0.9)
  for knob, measured, acc_base, acc_resa in ((0.05, 0.05, 0.7, 0.9), (0.1, 0.1, 0.9, 0.9)):
    recs += _budget("quest:adakv", knob, False, measured, acc_base)
    recs += _budget("quest:adakv", knob, True, measured, acc_resa)
  got = claims_sweeps.budget_reduction(recs)
  assert got.verdict == "reproduced" and "10.0% -> 5.0% (+50.0%)" in got.ours
  same = [dict(r, score=0.0) if r["resa"] and r["knob"] == 0.05 else r for r in recs]
  assert claims_sweeps.budget_reduction(same).verdict == "not reproduced"
  # why: each arm's best knob, and RESA's gain at equal knobs paired per sample (50 samples,
  # the two knobs averaged per sample: (0.9 + 0.9) / 2 - (0.7 + 0.9) / 2 = +10 points)
  assert ("quest:adakv: best 90.0 (knob 0.1) -> +RESA 90.0 (knob 0.05), +RESA - base at the "
          "same knob +10.0 pts [") in got.why
  assert "(n=50 samples, 2 knobs averaged per sample)" in got.why


def _layer(method, ctx, times):
  return dict(section="per_layer", dtype="float32", context=ctx, method=method, p_eff=0.1,
              times_ms=list(times), ms=float(np.median(times)))


def test_overhead_claims_use_paired_rounds():
  base = np.array([10.0, 20.0, 10.0, 20.0, 10.0, 20.0, 10.0])  # load varies by round
  recs = [_layer("quest:gqa=group", 8192, base),
          _layer("quest:gqa=group+resa", 8192, base * 1.02),
          _layer("quest:gqa=group+retro:w=8", 8192, base * 1.5)]
  got = claims_speed.resa_decode_overhead(recs)
  assert got.verdict == "reproduced" and "+2.0% [+2.0, +2.0]" in got.ours
  # Retro Table 6 times a whole model at batch 8: one attention layer is not comparable
  retro = claims_speed.retro_throughput_loss(recs)
  assert retro.verdict == "not comparable" and "+50.0%" in retro.ours
  recs += [_layer("dense", 8192, base * 5), _layer("quest:gqa=group+rect:f=32", 8192, base)]
  assert claims_speed.rectified_memory_access(recs).verdict == "reproduced"  # 0.2 vs 0.194
  mem = [dict(section="memory", method="dense", context=4096, layers=30, cache_bytes=100,
              peak_rss_mb=300.0, base_rss_mb=100.0),
         dict(section="memory", method="expected_attention:ratio=0.5", context=4096, layers=30,
              cache_bytes=52, peak_rss_mb=210.0, base_rss_mb=100.0)]
  assert claims_speed.ea_memory(mem).verdict == "reproduced"
  mem[1]["cache_bytes"] = 95
  assert claims_speed.ea_memory(mem).verdict == "not reproduced"


def _tail(method, x, nll, doc):
  return dict(experiment="perplexity", model="m", length=8192, view="tail", method=method, x=x,
              nll=nll, first_doc=doc, num_docs=1, eval_tokens=32)


def test_rectification_gap_closed_is_measured_against_decode_only():
  s = claims_generation.SPARSE
  recs = [r for d in range(4) for r in (
      _tail("dense", 1024, 2.0, d), _tail(s, 32, 2.05, d), _tail(s, 1024, 2.5, d),
      _tail("rectified", 1024, 2.06, d))]
  got = claims_generation.rectification_closes_gap(recs)
  assert got.verdict == "reproduced" and got.n == 128
  # a document measured again (another workdir of the experiment) is counted once
  again = claims_generation.rectification_closes_gap(recs + recs[:4])
  assert again.n == 128 and again.ours == got.ours
  # sparse decoding that does not drift leaves no gap: said so, not a NaN share
  flat = [dict(r, nll=2.04) if r["method"] == s and r["x"] == 1024 else r for r in recs]
  none = claims_generation.rectification_closes_gap(flat)
  assert none.verdict == "inconclusive" and none.ours.startswith("no gap to close")
  assert "nan" not in none.ours and "doc 3: decode-only 7.77" in none.why
  worse = [dict(r, nll=2.6) if r["method"] == "rectified" else r for r in recs]
  assert claims_generation.rectification_closes_gap(worse).verdict == "not reproduced"


def test_retro_effective_budget_against_the_papers_curve():
  def rec(w, f):
    return dict(experiment="long_generation", model="m", prompt_length=2048, new_tokens=256,
                retro_w=w, effective_budget_factor=f,
                effective_budget_steps=[[i, f + 0.01 * (i % 3)] for i in range(20)] if f else [])
  # one prompt: its steps are not independent samples, so no verdict
  one = claims_generation.retro_effective_budget([rec(1, None), rec(2, 1.2), rec(8, 1.55)])
  assert one.verdict == "inconclusive" and one.n == 1 and "1 prompt(s)" in one.ours
  many = [rec(w, f) for w, f in ((2, 1.2), (8, 1.55)) for _ in range(20)]
  got = claims_generation.retro_effective_budget(many)
  assert got.verdict == "reproduced" and got.n == 20
  # one run that batched 20 prompts: one record per window, one factor per prompt
  batched = [dict(rec(w, f), effective_budget_prompts=[f + 0.02 * (i % 5 - 2) for i in range(20)])
             for w, f in ((2, 1.2), (8, 1.55))]
  got = claims_generation.retro_effective_budget(batched + [rec(2, 1.9), rec(8, 1.9)])
  assert got.verdict == "reproduced" and got.n == 20 and "over 20 prompts" in got.ours
  assert "w=8: 1.55x [1.54, 1.56]" in got.ours
  low = claims_generation.retro_effective_budget([rec(w, f) for w, f in ((2, 1.02), (8, 1.05))
                                                  for _ in range(20)])
  assert low.verdict == "partly"


def test_gpu_records_are_read_apart_from_cpu_ones():
  base = np.array([10.0, 11.0, 10.0, 11.0])
  gpu = lambda r: dict(r, dtype="bfloat16", machine=dict(backend="gpu"), device="H100")
  cpu = [_layer("quest:gqa=group", 8192, base), _layer("quest:gqa=group+resa", 8192, base * 2)]
  recs = cpu + [gpu(_layer("quest:gqa=group,budget=500", 8192, base)),
                gpu(_layer("quest:gqa=group,budget=500+resa", 8192, base * 1.01)),
                dict(section="resa", context=8192, chunk=1024, dtype="bfloat16",
                     selector="quest:gqa=group", overhead_pct=5.0, machine=dict(backend="gpu"))]
  assert claims_speed.resa_decode_overhead(recs).verdict == "not reproduced"  # CPU: +100%
  got = claims_speed.resa_decode_overhead_gpu(recs)
  assert got.verdict == "reproduced" and "H100" in got.setting
  assert claims_speed.resa_prefill_overhead_gpu(recs).verdict == "reproduced"
  assert claims_speed.resa_prefill_overhead_gpu(cpu) is None


def test_resa_overheads_give_an_interval_per_context_over_its_rounds():
  base = np.array([10.0, 20.0, 10.0, 20.0, 10.0, 20.0, 10.0])
  recs = [_layer("quest:gqa=group", c, base) for c in (8192, 32768)]
  recs += [_layer("quest:gqa=group+resa", c, base * f) for c, f in ((8192, 1.02), (32768, 1.2))]
  got = claims_speed.resa_decode_overhead(recs)
  assert got.n == 7 and got.verdict == "not reproduced"  # rounds of one context
  assert "8k +2.0% [+2.0, +2.0] (+200 us); 32k +20.0% [+20.0, +20.0] (+2000 us)" == got.ours
  pre = [dict(section="resa", context=c, chunk=512, dtype="float32", selector="quest:gqa=group",
              overhead_pct=100 * (f - 1), selector_times_ms=list(base),
              resa_times_ms=list(base * f)) for c, f in ((8192, 1.05), (32768, 1.1))]
  got = claims_speed.resa_prefill_overhead(pre)
  assert got.ours == "8k +5.0% [+5.0, +5.0]; 32k +10.0% [+10.0, +10.0]"
  assert got.n == 7 and got.verdict == "partly"
  old = [{k: v for k, v in r.items() if not k.endswith("times_ms")} for r in pre]
  got = claims_speed.resa_prefill_overhead(old)  # records without rounds: no interval
  assert got.ours == "8k +5.0%; 32k +10.0%" and "no interval" in got.why


def test_rounds_pair_within_one_run_only():
  """A GPU row divides rounds of one run: an older run's method is never paired with a newer
  run's base (they ran days apart, under other code)."""
  base = np.array([10.0, 20.0, 10.0, 20.0])
  gpu = lambda r, run, t: dict(r, dtype="bfloat16", machine=dict(backend="gpu"), run=run,
                               time=t, device="H100")
  old = [gpu(_layer("quest:gqa=group", 8192, base), "old", "2026-11-24"),
         gpu(_layer("quest:gqa=group+retro:w=8", 8192, base * 1.5), "old", "2026-11-24"),
         gpu(_layer("dense", 8192, base * 5), "old", "2026-11-24"),
         gpu(_layer("quest:gqa=group+rect:f=32", 8192, base * 2), "old", "2026-11-24")]
  new = [gpu(_layer("quest:gqa=group", 8192, base * 3), "new", "2026-11-27"),
         gpu(_layer("dense", 8192, base * 20), "new", "2026-11-27")]
  for recs in (new + old, old + new):  # whichever file is read first
    retro = claims_speed.retro_throughput_loss_gpu(recs)
    assert "+50.0% [+50.0, +50.0]" in retro.ours
    rect = claims_speed.rectified_memory_access_gpu(recs)
    assert rect.ours.startswith("0.400 [0.400, 0.400]")


def test_an_overhead_interval_that_holds_the_limit_is_inconclusive():
  rows = lambda m, lo, hi: [(8192, m, lo, hi, 7)]
  assert claims_speed.overhead_verdict(rows(0.01, -0.01, 0.03), 0.0313) == "reproduced"
  assert claims_speed.overhead_verdict(rows(0.032, -0.2, 0.33), 0.0313) == "inconclusive"
  assert claims_speed.overhead_verdict(rows(0.02, -0.2, 0.33), 0.0313) == "inconclusive"
  assert claims_speed.overhead_verdict(rows(0.05, 0.04, 0.06), 0.0313) == "partly"
  assert claims_speed.overhead_verdict(rows(0.5, 0.4, 0.6), 0.0313) == "not reproduced"
  nan = float("nan")  # a context without rounds counts its mean
  assert claims_speed.overhead_verdict(rows(0.02, nan, nan), 0.0313) == "reproduced"
  assert claims_speed.overhead_verdict(rows(0.02, -0.01, 0.03) + rows(0.05, 0.04, 0.06),
                                       0.0313) == "partly"


def test_throughput_at_equal_quality_needs_an_equal_quality_budget():
  recs = _budget("dense", 0.0, False, 1.0, 0.9)
  for arm, acc in ((False, 0.5), (True, 0.6)):
    recs += _budget("quest:adakv", 0.1, arm, 0.1, acc)
  got = claims_sweeps.throughput_at_equal_quality(recs)
  assert got.verdict == "inconclusive" and got.ours.startswith("no equal-quality budget")
  recs = _budget("dense", 0.0, False, 1.0, 0.9)
  for knob, acc_base, acc_resa in ((0.05, 0.7, 0.9), (0.1, 0.9, 0.9)):
    recs += _budget("quest:adakv", knob, False, knob, acc_base)
    recs += _budget("quest:adakv", knob, True, knob, acc_resa)
  got = claims_sweeps.throughput_at_equal_quality(recs)
  assert "10.0% -> 5.0%, throughput not timed" in got.ours


def test_rectified_comparable_to_dense_rules_out_a_three_point_loss():
  from experiments.claims import tasks as claims_tasks
  def acc(method, scores):
    return [dict(experiment="accuracy", model="m", protocol="query_aware", method=method,
                 budget=None, task=claims_tasks.RESA_TABLE1_TASKS[i % 7], length=4096, seed=i,
                 depth=0.5, score=float(s), generator="nvidia-ruler")
            for i, s in enumerate(scores)]
  ones = np.ones(140)
  got = claims_tasks.rectified_comparable_to_dense(acc("dense", ones) + acc("rectified", ones))
  assert got.verdict == "reproduced" and got.n == 140
  assert "keep 5% (rectified:p=0.05): not run" in got.why
  half = (np.arange(140) % 2).astype(float)
  got = claims_tasks.rectified_comparable_to_dense(acc("dense", ones) + acc("rectified", half))
  assert got.verdict == "not reproduced"
  few = acc("dense", ones[:6]) + acc("rectified", [1, 1, 1, 1, 1, 0])  # too few to tell
  assert claims_tasks.rectified_comparable_to_dense(few).verdict == "inconclusive"
