"""2025's sparse decoders' claim rows (``experiments.claims.decoders_2025``) on synthetic
leaderboard records: each row's number and verdict, the tasks and budget it reads, "not run"."""

import numpy as np
import pytest

from experiments import registry
from experiments.claims import decoders_2025 as d25
from experiments.claims import report as claims_report
from experiments.claims import verdicts
from tests.claim_records import accuracy_records

ALL = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
       "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")


def grid(method, score, budget=0.025, tasks=ALL, lengths=(4096, 8192), n=5):
  """``n`` records per (task, length) of ``method`` (label ``method@budget`` as the leaderboard
  writes it); ``score(task, length, seed)`` gives each score."""
  label = method if budget is None else f"{method}@{budget:g}"
  return [r for t in tasks for length in lengths
          for r in accuracy_records(label, [score(t, length, i) for i in range(n)], task=t,
                                    length=length, budget=budget, generator="nvidia-ruler")]


def dense():
  return grid("dense", lambda *_: 1.0, budget=None)


@pytest.mark.parametrize("lo,hi,want", [(-0.02, 0.01, "reproduced"), (0.0, 0.05, "reproduced"),
                                        (-0.06, 0.0, "inconclusive"),
                                        (-0.2, -0.04, "not reproduced"),
                                        # the 3-point tolerance itself, on both sides
                                        (-0.03, 0.0, "reproduced"),
                                        (-0.0301, 0.0, "inconclusive"),
                                        (-0.1, -0.0301, "not reproduced"),
                                        (-0.1, -0.0299, "inconclusive")])
def test_comparable_verdict(lo, hi, want):
  assert verdicts.comparable_verdict(lo, hi) == want


def test_tidaldecode_reads_the_single_needle_tasks_at_two_and_a_half_percent():
  recs = dense() + grid("tidaldecode", lambda t, *_: 1.0 if t.startswith("niah_single")
                        else 0.0) + grid("tidaldecode", lambda *_: 0.0, budget=0.05)
  got = d25.tidaldecode_vs_dense(recs)
  assert got.verdict == "reproduced" and got.n == 30  # 3 tasks x 5 samples x 2 lengths
  assert got.ours.startswith("dense -> tidaldecode@0.025: 100.0 -> 100.0 (+0.0 pts")
  assert "[4096, 8192] tokens" in got.setting and "3 of its 3 tasks" in got.setting
  assert "Llama-3-8B" in got.setting  # the paper's setting beside ours
  # the other budget and the rest of the mix follow in the why, paired with dense
  assert "; at 0.05: 100.0 -> 0.0 (-100.0 pts" in got.why
  assert "; the other RULER tasks (tidaldecode@0.025) vs dense: 100.0 -> 0.0" in got.why
  assert {r["method"] for r in got.read} == {"dense", "tidaldecode@0.025"}


def test_a_loss_beyond_three_points_is_not_reproduced_and_a_small_sample_inconclusive():
  half = lambda t, length, i: float(i % 2)
  got = d25.shadowkv_vs_dense(dense() + grid("shadowkv", half) + grid("quest", half))
  assert got.verdict == "not reproduced" and got.n == 90  # ShadowKV Table 1's nine tasks
  assert "cwe" not in got.setting and "9 of its 9 tasks" in got.setting
  assert "; quest@0.025 -> shadowkv@0.025: 40.0 -> 40.0 (+0.0 pts" in got.why
  # one miss in six samples: a loss beyond 3 points is neither ruled out nor certain
  few = (grid("dense", lambda *_: 1.0, None, ("niah_single_1",), (4096,), 6)
         + grid("shadowkv", lambda t, length, i: float(i > 0), 0.025, ("niah_single_1",),
                (4096,), 6))
  got = d25.shadowkv_vs_dense(few)
  assert got.verdict == "inconclusive" and got.n == 6
  assert "dense -> shadowkv@0.025: 100.0 -> 83.3 (-16.7 pts" in got.ours


def test_twilight_reads_ten_percent_and_rocketkv_shows_stage_two():
  recs = (dense() + grid("twilight", lambda *_: 1.0, budget=0.1)
          + grid("twilight", lambda *_: 0.0, budget=0.025))
  got = d25.twilight_vs_dense(recs)
  assert got.verdict == "reproduced" and got.n == 120 and "twilight@0.1" in got.ours
  assert "; at 0.025: 100.0 -> 0.0" in got.why
  miss = lambda t, length, i: 0.0 if t == "cwe" else 1.0  # 10 of 120 missed: -8.3 points
  recs = dense() + grid("rocketkv", miss) + grid("hybrid", lambda *_: 1.0)
  got = d25.rocketkv_vs_dense(recs)
  assert got.verdict == "not reproduced" and got.n == 120
  assert "dense -> rocketkv@0.025: 100.0 -> 91.7 (-8.3 pts" in got.ours
  assert "; stage 2 alone (hybrid@0.025) vs dense: 100.0 -> 100.0" in got.why
  assert "rocketkv differs from dense on 1 of 12 tasks: cwe 100 -> 0" in got.why
  assert "; at 4096 tokens: 100.0 -> 91.7" in got.why


def test_a_length_still_running_is_not_pooled():
  recs = (dense() + grid("rocketkv", lambda *_: 1.0, lengths=(4096,))
          + grid("rocketkv", lambda *_: 0.0, tasks=ALL[:2], lengths=(8192,)))
  got = d25.rocketkv_vs_dense(recs)
  assert got.n == 60 and got.verdict == "reproduced"
  assert "8192 tokens still running (2 of 12 tasks), not pooled" in got.setting
  assert "; at 8192 tokens (2 of 12 tasks, not pooled): 100.0 -> 0.0" in got.why


def test_a_mix_short_of_its_planned_tasks_gets_no_verdict_yet():
  ran = ALL[:4]
  recs = (grid("dense", lambda *_: 1.0, None, ran, (4096,))
          + grid("twilight", lambda *_: 1.0, 0.1, ran, (4096,)))
  for r in recs:
    r["config"] = {"tasks": list(ALL)}  # the run plans all twelve
  got = d25.twilight_vs_dense(recs)
  assert got.verdict == "inconclusive" and got.n == 20
  assert "4 of the 12 planned tasks so far" in got.setting
  assert got.why.startswith("partial mix, so no verdict yet: on the 4 tasks that ran the rule "
                            "says 'reproduced'; no records yet for cwe, fwe, niah_multikey_2,")
  # the needle row plans only its three tasks: complete once they ran
  recs += grid("tidaldecode", lambda *_: 0.0, 0.025, ran, (4096,))
  for r in recs:
    r["config"] = {"tasks": list(ALL)}
  got = d25.tidaldecode_vs_dense(recs)
  assert got.verdict == "not reproduced" and "planned" not in got.setting


def test_rows_say_not_run_without_the_methods_records():
  for fn in (d25.tidaldecode_vs_dense, d25.shadowkv_vs_dense, d25.twilight_vs_dense,
             d25.rocketkv_vs_dense):
    assert fn(dense() + grid("quest", lambda *_: 1.0)) is None and fn([]) is None
  names = {"tidaldecode_vs_dense", "shadowkv_vs_dense", "twilight_vs_dense", "rocketkv_vs_dense"}
  part = {c.measure.split(":")[1]: c for c, p, _ in registry.claims()
          if p.name == "leaderboard_sparse"}
  assert set(part) == names
  for records in ({}, {"accuracy": dense()}):
    rows = {r["claim"]: r for r in claims_report.claim_rows(records, "results")}
    for c in part.values():
      assert rows[c.claim]["verdict"] == "not run" and rows[c.claim]["ours"] == "-"


def test_the_share_read_is_the_layer_mean_where_records_have_it():
  """A record's ``attended_tokens`` with ``layer_mean`` (layers that attend everything counted)
  gives the share; without it the share is a sparse layer's and says nothing of layers."""
  def with_reads(recs, **acc):
    return [dict(r, num_tokens=4000, attended_tokens=dict(total=100, **acc)) for r in recs]
  sparse_only = with_reads(grid("tidaldecode", lambda *_: 1.0, tasks=d25.NEEDLE_TASKS))
  got = d25.tidaldecode_vs_dense(dense() + sparse_only)
  assert "tidaldecode reads 2.5% of the context per head;" in got.why
  layered = with_reads(grid("tidaldecode", lambda *_: 1.0, tasks=d25.NEEDLE_TASKS),
                       layers=24, full_layers=4, layer_mean=(4 * 4000 + 20 * 100) / 24)
  got = d25.tidaldecode_vs_dense(dense() + layered)
  assert "tidaldecode reads 18.8% of the context per head (mean over the layers)" in got.why
