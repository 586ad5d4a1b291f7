"""The verdict rules on synthetic records: effect sizes, "inconclusive", RULER's generator,
RESA Table 1's seven tasks, and records that cannot be tied to code."""

import os

import numpy as np
import pytest

from experiments.claims import report as claims
from experiments.claims import row as claims_row
from experiments.claims import sweeps as claims_sweeps
from experiments.claims import tasks as claims_tasks
from experiments.claims import verdicts as claims_verdicts
from experiments.common import results
from tests.claim_records import accuracy_records

SEVEN = claims_tasks.RESA_TABLE1_TASKS


def _acc(method, scores, task, length=8192, budget=0.025, **extra):
  return accuracy_records(method, scores, task=task, length=length, budget=budget, **extra)


@pytest.mark.parametrize("d,lo,hi,want", [
    (0.05, 0.01, 0.09, "reproduced"),       # half the paper's gain or more, interval above 0
    (0.03, -0.01, 0.07, "partly"),          # half or more, interval holds 0
    (0.0, -0.064, 0.079, "inconclusive"),   # holds both 0 and the paper's +4.2
    (0.0, -0.03, 0.03, "not reproduced"),   # the paper's gain lies outside the interval
    (-0.05, -0.09, -0.01, "not reproduced"),
    # the boundary: at least half the paper's effect (0.021 of 0.042)
    (0.021, 0.001, 0.041, "reproduced"),
    (0.0209, 0.001, 0.041, "not reproduced"),
    (0.0209, -0.02, 0.042, "inconclusive"),
])
def test_effect_verdict(d, lo, hi, want):
  assert claims_verdicts.effect_verdict(d, lo, hi, 0.042) == want
  with pytest.raises(ValueError):
    claims_verdicts.effect_verdict(d, lo, hi, 0.0)


def test_resa_table1_averages_the_papers_seven_tasks_with_the_effect_rule():
  rng = np.random.default_rng(0)
  recs = []
  for task in SEVEN:  # RESA ahead by 10 points on each of the seven tasks
    base = (rng.random(20) < 0.5).astype(float)
    recs += _acc("quest", base, task) + _acc("resa-quest", np.maximum(base, np.arange(20) < 2),
                                             task)
  flat = _acc("quest", np.ones(20), "cwe") + _acc("resa-quest", np.zeros(20), "cwe")
  got = claims_tasks.resa_ruler_gain(recs + flat)  # cwe is not a Table 1 column: left out
  assert got.n == 140 and "RESA Table 1's 7 tasks" in got.setting
  assert "cwe" not in got.why
  d, lo, hi = claims_tasks.paired(claims_tasks.scores(recs, "resa-quest"),
                                  claims_tasks.scores(recs, "quest"))[2:5]
  assert got.verdict == claims_verdicts.effect_verdict(d, lo, hi, 0.042)
  small = [r for r in recs if r["seed"] < 5]  # 35 samples, +0: the interval decides nothing
  flip = lambda r: (r["seed"] + (r["method"] == "quest") + SEVEN.index(r["task"])) % 2
  same = [dict(r, score=float(flip(r))) for r in small]
  assert claims_tasks.resa_ruler_gain(same).verdict == "inconclusive"


def test_ruler_claims_prefer_records_of_rulers_generator():
  old = _acc("quest", np.zeros(20), "qa") + _acc("resa-quest", np.ones(20), "qa")
  got = claims_tasks.resa_ruler_gain(old)
  assert "earlier RULER variant" in got.setting and got.verdict == "reproduced"
  assert "(1 of 7 ran so far)" in got.setting  # a partial task mix is named
  new = [dict(r, seed=r["seed"] + 100, generator="nvidia-ruler", score=1.0 - r["score"])
         for r in old]
  got = claims_tasks.resa_ruler_gain(old + new)  # the aligned records alone decide
  assert got.n == 20 and got.verdict == "not reproduced"
  assert "earlier RULER variant" not in got.setting


def test_retro_longgen_gain_without_headroom_is_inconclusive():
  q = "quest:budget=0.15,min_tokens=256"
  half = np.r_[np.ones(20), np.zeros(20)]
  room = ([dict(r, spec=q) for r in _acc(q, half, "qa_multi", budget=None)]
          + _acc("retro", half, "qa_multi", budget=None))
  full = room + _acc("dense", np.ones(40), "qa_multi", budget=None)
  assert claims_tasks.retro_longgen_gain(full).verdict == "not reproduced"  # +0 with room
  tight = room + _acc("dense", np.r_[np.ones(20), np.zeros(19), [1.0]], "qa_multi",
                      budget=None)  # Quest is 2.5 points from dense: less than the +2.6
  got = claims_tasks.retro_longgen_gain(tight)
  assert got.verdict == "inconclusive" and "no headroom" in got.why


def test_budget_reduction_without_a_knob_in_tolerance_is_inconclusive():
  recs = [dict(experiment="budget_reduction", config=dict(model="m", tolerance=0.02,
                                                          tasks=["niah"]),
               family=f, knob=k, resa=resa, measured_budget=k, task="niah", length=2048,
               seed=i, depth=0.5, score=float(i < acc * 50))
          for f, k, resa, acc in (("dense", 0.0, False, 0.9), ("quest", 0.1, False, 0.5),
                                  ("quest", 0.1, True, 0.5)) for i in range(50)]
  got = claims_sweeps.budget_reduction(recs)
  assert got.verdict == "inconclusive" and "no knob within tolerance" in got.why


def test_records_from_a_modified_tree_are_refused_under_results_and_marked(tmp_path):
  root = tmp_path / "results"
  with pytest.raises(results.DirtyTree, match="commit first"):
    results.check_tied_to_code(str(root / "accuracy"), "abc+dirty", False, str(root))
  results.check_tied_to_code(str(root / "accuracy"), "abc+dirty", True, str(root))  # told
  results.check_tied_to_code(str(root / "accuracy"), "abc", False, str(root))  # clean
  results.check_tied_to_code(str(tmp_path / "elsewhere"), "abc+dirty", False, str(root))
  recs = _acc("quest", np.zeros(20), "qa") + _acc("resa-quest", np.ones(20), "qa")
  recs = [dict(r, git="abc+dirty" if r["seed"] < 3 else "abc") for r in recs]
  (row,) = [r for r in claims.claim_rows({"accuracy": recs}, str(root))
            if r["source"] == "RESA Table 1"]
  assert ("6 of the experiment's 40 records are from a modified tree and change this row's "
          "ours, n") in row["setting"]
  clean = [dict(r, git="abc") for r in recs]
  others = [dict(r, method="topk", spec="topk", git="abc+dirty") for r in recs]
  (row,) = [r for r in claims.claim_rows({"accuracy": clean + others}, str(root))
            if r["source"] == "RESA Table 1"]  # dirty records the row does not read: no mark
  assert "modified tree" not in row["setting"]


def test_report_names_rulers_differences_and_the_aligned_share():
  recs = [dict(r, generator="nvidia-ruler") for r in _acc("quest", np.ones(3), "qa")]
  text = claims.ruler_section(recs + _acc("quest", np.ones(2), "vt"))
  assert "3 of 5 accuracy records come from that generator" in text
  assert "qa_2 (HotpotQA) is not generated" in text


def test_readme_head_block_is_rewritten_from_the_claim_rows(tmp_path):
  readme = tmp_path / "README.md"
  readme.write_text(f"intro\n{claims.HEAD_START}\nold table\n{claims.HEAD_END}\nrest\n")
  rows = [dict(source="RESA Table 1", claim="gain", paper="+4.2", verdict="inconclusive")]
  assert claims.update_head(str(readme), rows)
  text = readme.read_text()
  assert "old table" not in text and text.startswith("intro\n") and text.endswith("rest\n")
  assert "| RESA Table 1: gain | +4.2 | inconclusive |" in text
  assert not claims.update_head(str(tmp_path / "none.md"), rows)


def test_leaderboard_keeps_rulers_generator_apart_from_the_earlier_variant():
  from experiments.claims import leaderboard as claims_leaderboard  # pylint: disable=g-import-not-at-top
  old = _acc("dense", np.ones(4), "qa", budget=None)
  new = [dict(r, generator="nvidia-ruler", score=0.0) for r in old]
  board = claims_leaderboard.rows(old + new)
  assert {(r["benchmark"], r["accuracy"]) for r in board} == {
      ("RULER", 100.0), ("RULER (NVIDIA generator)", 0.0)}


def _lam_rows(base_scores, lam_scores):
  """Accuracy records of quest and RESA at each lam; ``*_scores``: task -> 0/1 scores."""
  from experiments.claims import held_out
  recs = []
  for task, s in base_scores.items():
    recs += _acc("quest", s, task, generator="nvidia-ruler")
    for lam, by_task in lam_scores.items():
      label = held_out.lam_label("quest", lam)
      recs += _acc(f"{label}@0.025", by_task[task], task, generator="nvidia-ruler")
  return recs


def test_held_out_lam_is_chosen_without_the_task_it_scores():
  from experiments.claims import held_out
  tasks = ("niah_single_2", "niah_single_3", "qa")
  zeros = {t: np.zeros(10) for t in tasks}
  # lam 0.25 wins only on qa, lam 1 on the other two: qa's held-out lam is then 1 (no gain)
  lam_scores = {1.0: {"niah_single_2": np.ones(10), "niah_single_3": np.ones(10),
                      "qa": np.zeros(10)},
                0.5: zeros,
                0.25: {"niah_single_2": np.zeros(10), "niah_single_3": np.zeros(10),
                       "qa": np.ones(10)}}
  recs = _lam_rows(zeros, lam_scores)
  got, chosen, each = held_out.held_out_pair(recs, "quest", 8192)
  assert chosen == {"niah_single_2": 1.0, "niah_single_3": 1.0, "qa": 1.0}
  assert got[2] == pytest.approx(2 / 3) and each[0.25][2] == pytest.approx(1 / 3)
  row = held_out.resa_held_out_lam(recs)
  assert row.n == 30 and row.verdict == "reproduced" and "qa 1" in row.why


def test_held_out_lam_ties_go_to_the_larger_lam_and_missing_rows_give_none():
  from experiments.claims import held_out
  same = {"niah_single_2": np.ones(4), "qa": np.ones(4)}
  recs = _lam_rows({t: np.ones(4) for t in same}, {1.0: same, 0.5: same, 0.25: same})
  assert set(held_out.held_out_pair(recs, "quest", 8192)[1].values()) == {1.0}
  assert held_out.held_out_pair([r for r in recs if "0.5" not in r["method"]], "quest",
                                8192) is None


def test_calibrated_lam_row_pairs_the_fitted_rows_with_their_selector():
  from experiments.claims import held_out
  tasks = ("niah_single_2", "qa")
  fit = "resa-{}+calibrated:fit=results/calib/calibration_lambda@0.025"
  recs = []
  for task in tasks:
    recs += _acc("quest", np.zeros(20), task, generator="nvidia-ruler")
    recs += _acc(fit.format("quest"), np.ones(20), task, generator="nvidia-ruler")
    recs += _acc("arkvale", np.ones(20), task, generator="nvidia-ruler")
    recs += _acc(fit.format("arkvale"), np.ones(20), task, generator="nvidia-ruler")
  row = held_out.resa_calibrated_lam(recs)
  assert row.n == 40 and row.verdict == "reproduced" and row.ours.startswith("0.0 -> 100")
  assert "from results/calib/calibration_lambda (" in row.why  # the budget suffix cut
  assert "arkvale with the same fit" in row.why
  assert held_out.resa_calibrated_lam([r for r in recs if "calibrated" not in r["method"]]) is None


def test_cli_rewrites_the_readme_beside_its_workdir_only(tmp_path):
  """``python -m experiments.claims --workdir=X/results`` writes X/README.md's head block and
  leaves the README of the folder it runs in alone (a copy of results/ elsewhere used to
  rewrite the repository's head)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  block = f"x\n{claims.HEAD_START}\nold\n{claims.HEAD_END}\ny\n"
  (tmp_path / "results").mkdir()
  (tmp_path / "here").mkdir()
  for folder in (tmp_path, tmp_path / "here"):
    (folder / "README.md").write_text(block, encoding="utf-8")
  subprocess.run([sys.executable, "-m", "experiments.claims",
                  f"--workdir={tmp_path / 'results'}"], cwd=tmp_path / "here", check=True,
                 capture_output=True, env=dict(os.environ, PYTHONPATH=root))
  assert (tmp_path / "here" / "README.md").read_text(encoding="utf-8") == block
  written = (tmp_path / "README.md").read_text(encoding="utf-8")
  assert "\nold\n" not in written and "| claim | paper | verdict |" in written


def test_a_mark_follows_any_field_a_flagged_record_changes():
  """Dirty records behind only the ``why`` (a variant's score beside the row's numbers) mark
  the row too; records whose revision was declared are marked apart from dirty ones."""
  def measure(recs):
    base = [r for r in recs if r["method"] == "a"]
    variant = [r for r in recs if r["method"] == "v"]
    return claims_row.Measured(ours=f"{len(base)}", n=len(base), setting="s",
                               verdict="reproduced", why=f"variant {len(variant)}")
  recs = [dict(method="a", git="abc")] * 4 + [dict(method="v", git="abc+dirty")] * 2
  got = measure(recs)
  (note,) = claims_verdicts.provenance_notes(recs, measure, got)
  assert "2 of the experiment's 6 records are from a modified tree" in note and "why" in note
  gpu = [dict(method="a", git="abc", machine=dict(backend="gpu"))] * 3 + [
      dict(method="a", git="abc", machine=dict(backend="gpu"), git_declared=False)]
  got = measure(gpu)
  (note,) = claims_verdicts.provenance_notes(gpu, measure, got)
  assert note.startswith("3 of the experiment's 4 records have a declared revision")
  assert claims_verdicts.provenance_notes(gpu[3:], measure, measure(gpu[3:])) == []
  assert not claims_verdicts.is_declared(dict(git="abc+dirty", machine=dict(backend="gpu")))
  assert claims_verdicts.is_declared(dict(git="abc", git_declared=True))


def test_a_declared_revision_is_stored_as_declared(tmp_path, monkeypatch):
  monkeypatch.setenv("EXPERIMENT_REVISION", "0123abc")
  w = results.ResultWriter(str(tmp_path), dict(a=1), "x")
  w.write(dict(v=1), key="k")
  (rec,) = w.records()
  assert rec["git"] == "0123abc" and rec["git_declared"] and claims_verdicts.is_declared(rec)
  monkeypatch.delenv("EXPERIMENT_REVISION")
  w = results.ResultWriter(str(tmp_path / "b"), dict(a=1), "x")
  w.write(dict(v=1), key="k")
  assert "git_declared" not in w.records()[0]


def test_table1_pools_the_same_number_of_samples_per_task():
  """A slice that extended one task (45 samples) leaves the headline at the common count."""
  recs = []
  for t, n in (("qa", 45), ("niah_single_2", 15)):
    for m, s in (("quest", 0.0), ("resa-quest", 1.0 if t == "qa" else 0.0)):
      recs += [dict(r, seed=i) for i, r in enumerate(_acc(m, np.full(n, s), t))]
  (row,) = [r for r in claims.claim_rows({"accuracy": recs}, "/nonexistent")
            if r["source"] == "RESA Table 1"]
  assert row["n"] == 30 and "balanced: 15 samples per task (ran more: qa 45)" in row["setting"]
  assert row["ours"].startswith("0.0 -> 50.0")


def test_leaderboard_and_pairs_cut_every_task_to_the_same_count():
  from experiments.claims import leaderboard  # pylint: disable=g-import-not-at-top
  from experiments.tasks import accuracy_report  # pylint: disable=g-import-not-at-top
  recs = ([dict(r, seed=i) for i, r in enumerate(_acc("quest", np.ones(45), "qa"))]
          + [dict(r, seed=i) for i, r in enumerate(_acc("quest", np.zeros(15), "niah_single_2"))])
  recs = [dict(r, generator="nvidia-ruler") for r in recs]
  (row,) = leaderboard.rows(recs)
  assert row["accuracy"] == 50.0 and row["n"] == 30  # not 75.0 over 60 samples
  keys = accuracy_report.balanced_keys(accuracy_report._sample_id(r) for r in recs)  # pylint: disable=protected-access
  assert sorted(k[2] for k in keys if k[0] == "qa") == list(range(15))


def test_a_measure_returns_a_typed_row():
  """``row.Measured``: frozen; ``columns`` are the table's (``read`` is not one, nor compared)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  got = claims_row.Measured(ours="1", n=2, setting="s", verdict="reproduced", why="w",
                            read=[dict(a=1)])
  assert got.columns() == dict(ours="1", n=2, setting="s", verdict="reproduced", why="w")
  assert got == dataclasses.replace(got, read=None)
  with pytest.raises(dataclasses.FrozenInstanceError):
    got.why = "x"  # pylint: disable=assignment-from-no-return
  more = got.plus(setting="; t", why="; x", verdict="partly")
  assert (more.setting, more.why, more.verdict, more.read) == ("s; t", "w; x", "partly", [dict(a=1)])
  recs = _acc("quest", np.zeros(20), "qa") + _acc("resa-quest", np.ones(20), "qa")
  assert isinstance(claims_tasks.resa_ruler_gain(recs), claims_row.Measured)
