"""Expected Attention's claim rows (EA Table 1 on RULER, Fig. 3 on the needle grid) on synthetic
accuracy records: the best baseline, lengths pooled (or left out while running), variants."""

import numpy as np

from experiments.claims import compression as claims_compression
from tests.claim_records import acc as _acc


def test_ea_against_the_best_baseline():
  ones, half = np.ones(40), np.r_[np.ones(20), np.zeros(20)]
  recs = (_acc("expected-attention", ones, 0.5, protocol="query_agnostic")
          + _acc("snapkv", half, 0.5, protocol="query_agnostic")
          + _acc("knorm", np.zeros(40), 0.5, protocol="query_agnostic"))
  got = claims_compression.ea_vs_baselines(recs)
  assert got.verdict == "reproduced" and "snapkv" in got.ours
  flipped = (_acc("expected-attention", half, 0.5, protocol="query_agnostic")
             + _acc("snapkv", ones, 0.5, protocol="query_agnostic"))
  assert claims_compression.ea_vs_baselines(flipped).verdict == "not reproduced"
  labelled = [dict(r, method=f"{r['method']}@0.5") for r in recs]
  assert claims_compression.ea_vs_baselines(labelled).ours == got.ours
  assert "keep" not in got.why
  # the other kept fractions follow in "why": EA's rank there and its best baseline
  at_quarter = (_acc("expected-attention", half, 0.25, protocol="query_agnostic")
                + _acc("snapkv", np.zeros(40), 0.25, protocol="query_agnostic")
                + _acc("knorm", ones, 0.25, protocol="query_agnostic"))
  why = claims_compression.ea_vs_baselines(recs + at_quarter).why
  assert why.endswith("; keep 0.25: EA 50.0 (rank 2 of 3) vs knorm 100.0 (-50.0 pts "
                      f"[{why.split('pts [')[1].split(']')[0]}], n=40)")
  assert claims_compression.ea_vs_baselines(recs + at_quarter).ours == got.ours
  # presses beyond the paper's baselines (kvpress's board) are not EA Table 1's rivals
  board = _acc("compactor:head_budget=adakv", ones, 0.5, protocol="query_agnostic")
  assert claims_compression.ea_vs_baselines(recs + board).ours == got.ours


def test_ea_claim_reads_nvidias_generator_once_it_ran():
  """Aligned RULER records replace the earlier variant's; until then the row says so."""
  from experiments.claims import verdicts  # pylint: disable=g-import-not-at-top
  ones, zeros = np.ones(20), np.zeros(20)
  agnostic = dict(budget=0.5, protocol="query_agnostic")
  old = _acc("expected-attention", ones, **agnostic) + _acc("keydiff", zeros, **agnostic)
  assert "earlier RULER variant" in claims_compression.ea_vs_baselines(old).setting
  new = [dict(r, generator=verdicts.RULER_GENERATOR, score=1.0 - r["score"])
         for r in old[:10] + old[20:30]]
  got = claims_compression.ea_vs_baselines(old + new)
  assert got.n == 10 and got.verdict == "not reproduced"
  assert "earlier RULER variant" not in got.setting


def test_ea_claim_pools_lengths_and_lists_each():
  ones, half = np.ones(20), np.r_[np.ones(10), np.zeros(10)]
  agnostic = dict(budget=0.5, protocol="query_agnostic")
  recs = (_acc("expected-attention", ones, **agnostic) + _acc("keydiff", half, **agnostic)
          + _acc("expected-attention", half, length=8192, **agnostic)
          + _acc("keydiff", ones, length=8192, **agnostic))
  got = claims_compression.ea_vs_baselines(recs)
  # 40 paired samples (a sample is its task, length, seed): the means tie over both lengths
  assert got.n == 40 and "EA (expected-attention) 75.0 vs best baseline keydiff 75.0" in got.ours
  assert "; at 4096 tokens: EA 100.0 vs keydiff 50.0 (+50.0 pts" in got.why
  assert "; at 8192 tokens: EA 50.0 vs keydiff 100.0 (-50.0 pts" in got.why
  assert "at 4096 tokens" not in claims_compression.ea_vs_baselines(recs[:40]).why
  # where the pooled tie comes from, task by task (best baseline -> EA)
  split = [dict(r, task="cwe" if r["length"] == 4096 else "vt") for r in recs]
  assert "; per task keydiff -> EA, differs on 2 of 2 tasks: cwe 50 -> 100, vt 100 -> 50;" in (
      claims_compression.ea_vs_baselines(split).why)


def test_ea_claims_read_ruler_and_the_needle_grid_apart():
  ones, zeros = np.ones(40), np.zeros(40)
  grid = [dict(r, config=dict(heatmap=True))
          for r in (_acc("expected-attention:eps=0@0.5", zeros, 0.5, protocol="query_agnostic")
                    + _acc("keydiff@0.5", ones, 0.5, protocol="query_agnostic"))]
  ruler = (_acc("expected-attention@0.5", ones, 0.5, protocol="query_agnostic", task="vt")
           + _acc("keydiff@0.5", zeros, 0.5, protocol="query_agnostic", task="vt"))
  assert claims_compression.ea_vs_baselines(grid + ruler).verdict == "reproduced"
  niah = claims_compression.ea_vs_baselines_niah(grid + ruler)
  assert niah.verdict == "not reproduced" and "keydiff 100.0" in niah.ours
  # the other EA setting on the grid is a variant: shown, neither EA nor a baseline
  default = [dict(r, config=dict(heatmap=True)) for r in
             _acc("expected-attention@0.5", ones, 0.5, protocol="query_agnostic")]
  both = claims_compression.ea_vs_baselines_niah(grid + default + ruler)
  assert both.ours == niah.ours and "variant expected-attention 100.0 vs EA 0.0 (+100.0 pts" in both.why


def test_ea_variants_are_paired_with_ea_at_every_kept_fraction():
  ones, half = np.ones(40), np.r_[np.ones(20), np.zeros(20)]
  recs = []
  for b in (0.5, 0.1):
    recs += (_acc(f"expected-attention@{b}", ones, b, protocol="query_agnostic")
             + _acc(f"keydiff@{b}", half, b, protocol="query_agnostic")
             + _acc(f"expected-attention:head_budget=uniform@{b}", half[:30], b,
                    protocol="query_agnostic"))  # an ablation on a subset of the samples
  why = claims_compression.ea_vs_baselines(recs).why
  uniform = "expected-attention:head_budget=uniform"
  assert f"; variant {uniform} 66.7 vs EA 100.0 (-33.3 pts" in why and "n=30)" in why
  assert f"keep 0.1: EA 100.0 (rank 1 of 2) vs keydiff 50.0" in why
  assert f", variant {uniform} 66.7 vs EA 100.0" in why.split("keep 0.1:")[1]


def test_ea_claim_leaves_a_length_still_running_out_of_the_pool():
  """A length holding a strict subset of another length's tasks (its grid still running) is
  shown on its own, not pooled: pooled, it would weigh the tasks it has more."""
  ones, zeros = np.ones(20), np.zeros(20)
  agnostic = dict(budget=0.5, protocol="query_agnostic")
  full = []
  for task in ("cwe", "vt"):
    full += (_acc("expected-attention", ones, task=task, **agnostic)
             + _acc("keydiff", zeros, task=task, **agnostic))
  running = (_acc("expected-attention", zeros, length=8192, task="vt", **agnostic)
             + _acc("keydiff", ones, length=8192, task="vt", **agnostic))
  got = claims_compression.ea_vs_baselines(full + running)
  assert got.n == 40 and got.verdict == "reproduced"
  assert "[4096] tokens" in got.setting
  assert "8192 tokens still running (1 of 2 tasks), not pooled" in got.setting
  assert "; at 8192 tokens (1 of 2 tasks, not pooled): EA 0.0 vs keydiff 100.0" in got.why
  # dense's mean is over the pooled lengths too
  dense = (_acc("dense", np.ones(40), None, protocol="query_agnostic")
           + _acc("dense", np.zeros(20), None, length=8192, task="vt", protocol="query_agnostic"))
  assert "; dense 100;" in claims_compression.ea_vs_baselines(full + running + dense).why
  # once the length holds every task it is pooled
  done = running + [dict(r, task="cwe") for r in running]
  assert claims_compression.ea_vs_baselines(full + done).n == 80
