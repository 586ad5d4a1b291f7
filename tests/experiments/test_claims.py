"""The reproduction report: claim measures on synthetic records, the report and the runner."""

import json
import os

import numpy as np
import pytest
from absl import app

from experiments import registry, reproduce
from experiments.claims import leaderboard as claims_leaderboard
from experiments.claims import report as claims
from experiments.claims import table as claims_table
from experiments.claims import tasks as claims_tasks
from tests.claim_records import acc as _acc


def test_resa_gain_is_paired_and_judged_by_its_interval():
  rng = np.random.default_rng(0)
  base = (rng.random(60) < 0.5).astype(float)
  better = np.maximum(base, (rng.random(60) < 0.5))  # never worse, often better
  recs = _acc("quest", base) + _acc("resa-quest", better)
  got = claims_tasks.resa_ruler_gain(recs)
  assert got.n == 60 and got.verdict == "reproduced"
  assert f"{100 * base.mean():.1f} -> {100 * better.mean():.1f}" in got.ours
  same = claims_tasks.resa_ruler_gain(_acc("quest", base) + _acc("resa-quest", base))
  assert same.verdict == "not reproduced"
  # unpaired samples (other seeds) are not compared
  shifted = [dict(r, seed=r["seed"] + 100) for r in _acc("resa-quest", better)]
  assert claims_tasks.resa_ruler_gain(_acc("quest", base) + shifted) is None
  # the accuracy experiment labels rows spec@budget
  labelled = _acc("quest@0.025", base) + _acc("resa-quest@0.025", better)
  assert claims_tasks.resa_ruler_gain(labelled).ours == got.ours
  assert "differs on 1 of 1 tasks: niah_single_2 " in got.why
  assert claims_tasks.task_differences({("a", 1): 1.0, ("b", 1): 0.0, ("b", 2): 1.0},
                                       {("a", 1): 1.0, ("b", 1): 1.0, ("b", 2): 1.0}) == (
      "; differs on 1 of 2 tasks: b 100 -> 50")
  # the table's other selectors, on the same samples, join the why
  both = recs + _acc("arkvale@0.025", better) + _acc("resa-arkvale@0.025", base)
  why = claims_tasks.resa_ruler_gain(both).why
  assert f"ArkVale {100 * better.mean():.1f} -> {100 * base.mean():.1f}" in why
  assert "n=60; paper +4.0, +4.5" in why and "top-k" not in why
  # at 8k the row reads 8k; 4k's pair follows in its why (the gain's trend with length)
  longer = [dict(r, length=8192) for r in _acc("quest", better) + _acc("resa-quest", base)]
  at8k = claims_tasks.resa_ruler_gain(recs + longer)
  assert "8192 tokens" in at8k.setting and at8k.verdict == "not reproduced"
  trend = at8k.why.split("; at 4096 tokens ")[1]
  assert trend == got.ours.split(", McNemar")[0] + ", n=60)"
  # the share of the context Quest reads at the claim's length (budget + forced tokens)
  assert "reads" not in got.why
  read = [dict(r, attended_tokens=dict(total=t), num_tokens=8192)
          for r, t in zip(longer[:60], np.r_[np.full(30, 300), np.full(30, 356)])]
  assert "; Quest reads 4.0% of the context per head" in claims_tasks.resa_ruler_gain(
      recs + read + longer[60:]).why


def test_resa_gain_counts_answers_identical_to_dense():
  base, ones = np.r_[np.ones(30), np.zeros(30)], np.ones(60)
  said = lambda recs, words: [dict(r, prediction=w) for r, w in zip(recs, words)]
  dense = said(_acc("dense", ones, None), ["a"] * 60)
  topk = said(_acc("topk", ones), ["a"] * 20 + ["b"] * 40)
  resa_topk = said(_acc("resa-topk", base), ["a"] * 50 + ["b"] * 10)
  recs = _acc("quest", base) + _acc("resa-quest", base) + dense + topk + resa_topk
  why = claims_tasks.resa_ruler_gain(recs).why
  # Quest's rows hold no answers: only top-k is counted
  assert "; answers identical to dense's without -> with RESA: Ideal top-k 20 -> 50 of 60" in why
  assert "Quest 0" not in why
  assert "identical" not in claims_tasks.resa_ruler_gain(recs[:-60]).why


def test_svd_claims_follow_their_rules():
  lengths = (512, 1024, 2048)
  recs = [dict(experiment="svd_analysis", config=dict(model="m"), kind="spectrum", layer=l,
               length=s, share=[0.45, 0.42], key_cosine=[0.95, 0.97], cosine=[0.2, -0.3],
               s=[[s * 0.01 + l, 1.0], [s * 0.02, 1.0]]) for l in range(2) for s in lengths]
  assert claims_table.principal_share(recs).verdict == "reproduced"
  # the paper's row-wise |cos| (key_cosine), not the Frobenius cosine (low here)
  assert claims_table.rank1_cosine(recs).verdict == "reproduced"
  assert "key_cosine" in claims_table.rank1_cosine(recs).setting
  rows = [dict(r, row_cosine=[-0.95, 0.5]) for r in recs]  # the signed row mean: shown only
  got = claims_table.rank1_cosine(rows)
  assert got.ours.startswith("median abs cos 0.960") and "signed row mean" in got.why
  assert claims_table.sigma1_linear(recs).verdict == "reproduced"
  low = [dict(r, share=[0.2, 0.25]) for r in recs]
  assert claims_table.principal_share(low).verdict == "not reproduced"


def test_report_lists_unrun_claims_and_timings(tmp_path):
  os.makedirs(tmp_path / "accuracy")
  recs = _acc("dense", np.ones(5)) + _acc("quest", np.zeros(5))
  # two runs a day apart: 2 min (the first record's batch took 60 s) + 1 min
  stamps = ["2026-01-01T10:01:00+00:00", "2026-01-01T10:01:30+00:00", "2026-01-01T10:02:00",
            "2026-01-02T08:00:00+00:00", "2026-01-02T08:01:00+00:00"] * 2
  for i, (r, t) in enumerate(zip(recs, stamps)):
    r.update(time=t if t.endswith("+00:00") else t + "+00:00")
    if i == 0:
      r["batch_seconds"] = 60.0
  with open(tmp_path / "accuracy" / "results.jsonl", "w", encoding="utf-8") as f:
    for r in recs:
      f.write(json.dumps(r) + "\n")
  with open(tmp_path / "timings.jsonl", "w", encoding="utf-8") as f:  # only the second run
    f.write(json.dumps(dict(part="accuracy", seconds=600.0, rc=0,
                            finished="2025-12-30T00:00:00")) + "\n")
    f.write(json.dumps(dict(part="accuracy", seconds=120.0, rc=0,
                            finished="2026-01-02T08:02:00")) + "\n")
  text = open(claims.build(str(tmp_path)), encoding="utf-8").read()
  assert "| not run |" in text and "no `svd_analysis` records" in text
  assert "Leaderboard" in text and "**RULER, query_aware**" in text and "| dense |" in text
  assert "3 min in all" in text
  assert "| accuracy | 3 | 2 | 10 | 2026-01-01T10:01 | 2026-01-02T08:01 | 2 |" in text


def _tables(text: str) -> dict:
  """``{title: [row cells]}`` of the leaderboard's markdown (one table per title line)."""
  out, title = {}, None
  for line in text.splitlines():
    if line.startswith("**"):
      title = line[2:line.index("**", 2)]
      out[title] = []
    elif line.startswith("| ") and not line.startswith("| method "):
      out[title].append([c.strip() for c in line.strip("|").split("|")])
  return out


def test_leaderboard_keeps_ruler_the_needle_grid_and_long_generation_qa_apart():
  grid = [dict(r, config=dict(heatmap=True)) for r in _acc("dense", np.ones(4), length=1024,
                                                          protocol="query_agnostic")]
  qa = _acc("dense", np.zeros(3), length=2048, task="qa_multi")
  ruler = _acc("dense", np.ones(2), length=1024, protocol="query_agnostic", task="vt")
  aware = _acc("dense", np.ones(2), length=1024)
  tables = _tables(claims_leaderboard.markdown(claims_leaderboard.rows(grid + qa + ruler + aware)))
  assert list(tables) == ["RULER, query_aware", "RULER, query_agnostic",
                          "needle grid, query_agnostic", "long-gen QA, query_aware"]
  dense = tables["needle grid, query_agnostic"][0]
  assert dense[0] == "dense" and dense[2].endswith("(4)") and dense[-1] == "1"
  assert tables["RULER, query_agnostic"][0][2].endswith("(2)")
  assert dense[3] == "-"  # dense reads everything, nothing recorded


def test_leaderboard_puts_the_lengths_side_by_side():
  """One row per method x budget, a column per length; a row a length lacks says so, and rows
  sort by the longest length's accuracy."""
  recs = (_acc("dense", [1, 1]) + _acc("quest@0.025", [1, 0]) + _acc("topk@0.025", [1, 1])
          + _acc("dense", [1, 0], length=8192) + _acc("quest@0.025", [0, 0], length=8192)
          + _acc("resa-quest@0.025", [1, 0], length=8192))
  (rows,) = _tables(claims_leaderboard.markdown(claims_leaderboard.rows(recs))).values()
  assert [r[0] for r in rows] == ["dense", "resa-quest@0.025", "quest@0.025", "topk@0.025"]
  quest = rows[2]
  assert quest[2].startswith("50.0 [") and quest[2].endswith("(2)")
  assert quest[3].startswith("0.0 [") and rows[1][2] == "not run" and rows[3][3] == "not run"


def test_leaderboard_shows_the_share_of_the_context_each_row_reads():
  quest = [dict(r, attended_tokens=dict(total=t), num_tokens=1000)
           for r, t in zip(_acc("quest@0.025", [1, 0]), (40, 60))]
  snap = [dict(r, kv_kept=k, context_tokens=400, attended_tokens=None)
          for r, k in zip(_acc("snapkv@0.5", [1, 1], 0.5, protocol="query_agnostic"),
                          (200.0, 196.0))]
  board = claims_leaderboard.rows(quest + snap)
  tables = _tables(claims_leaderboard.markdown(board))
  assert tables["RULER, query_aware"][0][:2] == ["quest@0.025", "0.025"]
  assert tables["RULER, query_aware"][0][3] == "5.0%"
  assert tables["RULER, query_agnostic"][0][3] == "49.5%"
  got = {r["method"]: r for r in board}
  assert got["quest@0.025"]["share"] == pytest.approx(0.05)
  assert (got["quest@0.025"]["lo"], got["quest@0.025"]["hi"]) == pytest.approx(
      tuple(100 * x for x in claims_leaderboard.stats.wilson(1, 2)))


def test_leaderboard_figure_has_a_panel_per_benchmark_protocol_and_length(tmp_path):
  recs = (_acc("dense", [1, 1]) + [dict(r, attended_tokens=dict(total=50), num_tokens=1000)
                                   for r in _acc("quest@0.025", [1, 0])]
          + _acc("dense", [1, 0], length=8192))
  path = claims_leaderboard.figure(claims_leaderboard.rows(recs), str(tmp_path))
  assert os.path.getsize(path) > 10_000
  assert claims_leaderboard.figure([], str(tmp_path)) is None


def test_reproduce_plan_and_bad_names():
  every = [p.name for p, _ in registry.parts()]
  assert [n for n, _ in reproduce.plan()] == every
  assert [n for n, _ in reproduce.plan(["latency", "svd_analysis"])] == ["svd_analysis",
                                                                         "latency"]
  with pytest.raises(app.UsageError, match="unknown part"):
    reproduce.plan(["svd"])
  line = reproduce.eta_line(1, reproduce.plan(), 600.0, {"svd_analysis": 1200.0})
  assert line.startswith(f"[1/{len(every)}] elapsed 10.0 min, eta")


def test_score_error_reduction_uses_the_per_head_statistic():
  base = np.full((3, 4), 0.5)
  recs = []
  for spec, scale in (("quest", 1.0), ("quest+resa:lam=1.0", 0.4)):
    rec = dict(experiment="attention_error", config=dict(model="m"), spec=spec, budget=0.05,
               prefill_len=64, attended=np.full((3, 4), 0.1))
    for m in ("score_l1", "score_rel_l2", "out_rel_l2", "out_rel_l2_retired"):
      rec[m] = base * scale
    recs.append(rec)
  got = claims_table.score_error_reduction(recs)
  assert got.verdict == "reproduced" and got.ours.startswith("median 60.0%")
  weak = [dict(r, score_l1=base * 0.9) if "+" in r["spec"] else r for r in recs]
  assert claims_table.score_error_reduction(weak).verdict == "not reproduced"
  # two models are measured apart (never pooled) and the weakest verdict decides
  other = [dict(r, config=dict(model="other")) for r in weak]
  both = claims_table.score_error_reduction(recs + other)
  assert both.verdict == "not reproduced" and both.n == 8
  assert both.ours.startswith("m: median 60.0%") and "other: median 10.0%" in both.ours


def test_retro_longgen_gain_pairs_retro_with_its_quest_and_shows_dense():
  q = "quest:budget=0.15,min_tokens=256"
  half, ones = np.r_[np.ones(20), np.zeros(20)], np.ones(40)
  recs = (_acc("dense", ones, None, task="qa_multi")
          + [dict(r, spec=q) for r in _acc(q, half, None, task="qa_multi")]
          + _acc("retro", ones, None, task="qa_multi"))
  got = claims_tasks.retro_longgen_gain(recs)
  assert got.verdict == "reproduced" and got.n == 40
  assert "dense 100.0" in got.why
  # the config's other pairs (w = 4, a lower budget) are shown, paired, where both rows ran
  q05, r05 = "quest:budget=0.05,min_tokens=64", "retro:budget=0.05,min_tokens=64"
  pairs = [("retro", q), ("retro:w=4", q), (r05, q05)]
  more = [dict(r, config=dict(pairs=pairs)) for r in
          recs + _acc(q05, np.zeros(40), None, task="qa_multi")
          + _acc(r05, half, None, task="qa_multi")]
  why = claims_tasks.retro_longgen_gain(more).why
  assert f"; {r05} vs {q05}: 0.0 -> 50.0 (+50.0 pts [" in why and why.endswith("n=40)")
  assert "retro:w=4" not in why  # not run: not shown


def test_report_shows_the_needle_diagnosis_when_its_records_exist():
  def rec(method, depth, w):
    return dict(experiment="needle_keep", method=method, depth=depth, needle_recall=w,
                weighted_recall=w, heads_with_needle=w, kept_fraction=0.5,
                config=dict(model="m", tasks=["niah_single_2"], lengths=[2048]))
  recs = [rec("keydiff@0.5", 0.2, 0.9), rec("keydiff@0.5", 0.8, 0.7),
          rec("expected-attention@0.5", 0.2, 0.4), rec("expected-attention@0.5", 0.8, 0.8)]
  text = claims.needle_diagnosis(recs)
  assert "## Diagnosis" in text and "| keydiff@0.5 | 80 | 90 | 70 |" in text
  assert text.index("keydiff") < text.index("expected-attention@0.5 | 60 | 40 | 80 |")
  assert claims.needle_diagnosis([]) == ""
  assert "modified tree" not in text  # records without a revision are not flagged
  recs[1]["git"], recs[2]["git"] = "abc1234+dirty", "abc1234+unverified"
  flagged = claims.needle_diagnosis(recs)
  assert "⚠ 1 of its 4 records are from a modified tree" in flagged


def test_leaderboard_names_the_rows_a_length_has_not_run():
  recs = (_acc("dense", [1, 1]) + _acc("quest@0.025", [1, 0]) + _acc("topk@0.025", [1, 1])
          + _acc("dense", [1, 0], length=8192) + _acc("quest@0.025", [0, 0], length=8192))
  gaps = claims_leaderboard.missing(claims_leaderboard.rows(recs))
  assert gaps == "- not run at 8192 tokens (RULER, query_aware): topk@0.025"
  assert claims_leaderboard.missing(claims_leaderboard.rows(recs[:6])) == ""


def test_leaderboard_flags_a_row_on_fewer_tasks_than_dense():
  recs = (_acc("dense", [1, 1], task="a") + _acc("dense", [1, 0], task="b")
          + _acc("quest@0.025", [1, 1], task="a") + _acc("quest@0.025", [1, 0], task="b")
          + _acc("topk@0.025", [1, 1], task="a"))
  board = claims_leaderboard.rows(recs)
  (rows,) = _tables(claims_leaderboard.markdown(board)).values()
  cell = {r[0]: r[2] for r in rows}
  assert cell["topk@0.025"].endswith("(2, 1 of 2 tasks)") and cell["quest@0.025"].endswith("(4)")
  assert claims_leaderboard.missing(board) == (
      "- fewer tasks than dense at 4096 tokens (RULER, query_aware): topk@0.025 (1 of 2 tasks)")


def test_leaderboard_names_a_length_one_protocol_has_not_run_at_all():
  agnostic = _acc("dense", [1, 1], protocol="query_agnostic") + _acc(
      "knorm@0.5", [0, 1], 0.5, protocol="query_agnostic")
  aware = _acc("dense", [1, 1]) + _acc("dense", [1, 0], length=8192)
  gaps = claims_leaderboard.missing(claims_leaderboard.rows(aware + agnostic))
  assert gaps == ("- not run at 8192 tokens (RULER, query_agnostic): no row "
                  "(2 rows ran at other lengths)")


def test_leaderboard_pools_the_needle_grid_over_its_lengths():
  grid = [dict(r, config=dict(heatmap=True))
          for n in (1024, 4096) for r in _acc("keydiff@0.5", [1, 0, 1], 0.5, length=n,
                                               protocol="query_agnostic")]
  board = claims_leaderboard.rows(grid + _acc("dense", [1, 1], length=1024))
  got = {(r["benchmark"], r["length"]): r for r in board}
  assert got[("needle grid", "1024-4096")]["n"] == 6
  assert got[("needle grid", "1024-4096")]["accuracy"] == pytest.approx(100 * 4 / 6, abs=0.05)
  assert got[("RULER", 1024)]["n"] == 2  # RULER keeps its lengths apart


def test_resa_gain_names_the_other_budgets_at_its_length():
  base = np.array([1, 0, 1, 0] * 5, float)
  recs = (_acc("quest@0.025", base, 0.025) + _acc("resa-quest@0.025", base, 0.025)
          + _acc("quest@0.1", base, 0.1) + _acc("resa-quest@0.1", np.ones(20), 0.1))
  got = claims_tasks.resa_ruler_gain(recs)
  assert "; at budget 0.1 50.0 -> 100.0 (+50.0 pts" in got.why and got.n == 20


def test_leaderboard_counts_a_sample_two_workdirs_ran_once():
  grid = _acc("quest", [1, 0, 1])
  headline = _acc("quest", [1, 0, 1, 0, 0])  # the same first three seeds, then two more
  (row,) = claims_leaderboard.rows(grid + headline)
  assert row["n"] == 5 and row["accuracy"] == 40.0
