"""Each task experiment's ``--config.quick=True`` run on tiny-random, then the report over all.

Runs in-process (the jit caches are shared across the scripts); numbers of a random model
mean nothing, so the checks are: outputs exist, values are finite and in range, resume works.
"""

import json
import math
import os
import re

import pytest

import numpy as np

from configs import budget_reduction as br_config
from configs import resa_lambda as rl_config
from experiments import merge, report
from experiments.analysis import budget_reduction, resa_lambda
from experiments.common import results
from experiments.common import quick
from experiments.tasks import accuracy, long_generation, perplexity


def _quick(name):
  module = __import__(f"configs.{name}", fromlist=["get_config"])
  c = module.get_config()
  with c.unlocked():
    c.quick = True
  return quick.resolve(c, quick.module_get_config(name))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return str(tmp_path_factory.mktemp("results"))


def _finite(x):
  return isinstance(x, (int, float)) and math.isfinite(x)


def test_accuracy_quick_and_resume(root):
  cfg = _quick("accuracy")
  wd = os.path.join(root, "accuracy")
  recs = accuracy.run(cfg, wd)
  n_methods = len(cfg.methods) + 2 * (len(cfg.budgets) - 1)  # quest, resa-quest x budgets
  assert len(recs) == n_methods * len(cfg.tasks) * len(cfg.lengths) * cfg.num_samples
  for r in recs:  # tokens attended per head: forced + chosen = total, None for dense only
    att = r["attended_tokens"]
    assert (att is None) == (r["method"] == "dense")
    if att:
      assert att["forced"] + att["chosen"] == att["total"] and att["chosen"] > 0
    assert r["protocol"] == "query_aware" and 0 < r["context_tokens"] < r["num_tokens"]
  assert all(0.0 <= r["score"] <= 1.0 and r["model"] == "tiny-random" for r in recs)
  # within one haystack unit of the target: a noise line, or a QA document
  assert all(0 <= r["length"] - r["num_tokens"] <= (300 if r["task"] == "qa" else 40)
             for r in recs)
  assert all(r["new_tokens"] <= cfg.max_new_tokens and "git" in r for r in recs)
  md = open(os.path.join(wd, "accuracy.md"), encoding="utf-8").read()
  assert "tiny-random" in md and md.index("| dense |") < md.index("| quest")
  assert os.path.exists(os.path.join(wd, "accuracy_vs_length.png"))
  again = accuracy.run(cfg, wd)  # resume: everything done, nothing appended
  assert len(again) == len(recs)
  assert "Paired comparisons" in md and "resa-quest | quest" in md


def test_compression_query_agnostic_quick(root):
  """EA vs baselines: the context is compressed before the question; every method and ratio
  keeps its share of the cache; the dense row reads the same shared prefill; a selector
  (Quest) reads the question one decode step per token."""
  cfg = _quick("accuracy_compression")
  with cfg.unlocked():
    cfg.methods = tuple(cfg.methods) + ("quest",)
  recs = accuracy.run(cfg, os.path.join(root, "accuracy_compression"))
  assert len(recs) == len(cfg.methods) * len(cfg.tasks) * len(cfg.lengths) * cfg.num_samples
  for r in recs:
    assert r["protocol"] == "query_agnostic"
    assert (r["attended_tokens"] is None) == (r["method"] != "quest@0.5")
    if r["method"] in ("dense", "quest@0.5"):
      assert r["kv_kept"] is None
    else:  # half the context kept per kv head (Ada-KV: on average over heads)
      assert abs(r["kv_kept"] - 0.5 * r["context_tokens"]) <= 1.0, r


def test_niah_heatmap_quick(root):
  cfg = _quick("niah_heatmap")
  wd = os.path.join(root, "niah_heatmap")
  recs = accuracy.run(cfg, wd)
  assert {r["depth"] for r in recs} == set(cfg.depths)
  assert {r["length"] for r in recs} == set(cfg.lengths)
  assert os.path.exists(os.path.join(wd, "niah_heatmap.png"))
  md = open(os.path.join(wd, "accuracy.md"), encoding="utf-8").read()
  assert "expected-attention:eps=0 | snapkv" in md


def test_long_generation_qa_quick(root):
  cfg = _quick("long_generation_qa")
  recs = accuracy.run(cfg, os.path.join(root, "long_generation_qa"))
  assert len(recs) == len(cfg.methods) * cfg.num_samples
  for r in recs:
    assert r["metric"] == "each" and len(r["answers"]) == cfg.questions
    assert len(r["question_scores"]) == cfg.questions
    assert r["score"] == pytest.approx(np.mean(r["question_scores"]))


def test_resa_lambda_quick(tmp_path):
  cfg = rl_config.get_config(True)
  rows = resa_lambda.run(cfg, str(tmp_path))
  assert (tmp_path / "fig7a_lambda_sweep.png").exists()
  # dense, lam 0 and 1 once, lam 0.5 in both forms; every cell over the same samples
  assert len(rows) == len(cfg.tasks) * 5
  assert {r["n"] for r in rows} == {cfg.num_samples}
  forms = {(r["lam"], r["form"]) for r in rows}
  assert {(0.5, "renormalised"), (0.5, "literal"), (1.0, "renormalised")} <= forms
  zero = [r for r in results.read_records(str(tmp_path / results.RESULTS_FILE))
          if r.get("lam") == 0.0]
  assert zero and all(r["attended_tokens"]["chosen"] > 0 for r in zero)


def test_budget_reduction_quick(tmp_path):
  cfg = br_config.get_config(True)
  red = budget_reduction.run(cfg, str(tmp_path))
  assert (tmp_path / "fig7b_budget_reduction.png").exists()
  assert {r["family"] for r in red} == {"quest:topp", "quest:adakv"}
  recs = results.read_records(str(tmp_path / results.RESULTS_FILE))
  assert len(recs) == (1 + 2 * 2) * cfg.num_samples
  for r in recs:
    assert 0 < r["measured_budget"] <= 1 and 0 <= r["score"] <= 1


def test_perplexity_quick(root):
  cfg = _quick("perplexity")
  wd = os.path.join(root, "perplexity")
  recs = perplexity.run(cfg, wd)
  tail = [r for r in recs if r["view"] == "tail"]
  inter = [r for r in recs if r["view"] == "interval"]
  assert {r["method"] for r in tail} >= {"dense", "quest:p=0.2", "quest:p=0.2+rect:f=4"}
  assert len(tail) == len({r["method"] for r in tail}) * cfg.num_docs  # one doc per record
  merged = perplexity.merge(tail)
  assert all(r["num_docs"] == cfg.num_docs for r in merged)
  assert all(_finite(r["nll"]) and _finite(r["kl"]) and r["kl"] >= 0 for r in recs)
  assert all(r["batch_seconds"] > 0 for r in recs)  # the report's wall time reads it
  dense = [r for r in tail if r["method"] == "dense"][0]
  assert dense["kl"] == pytest.approx(0.0, abs=1e-5) and dense["agree"] == 1.0
  assert inter and all(len(r["nll_intervals"]) == (cfg.interval_length // 2) // cfg.interval
                       for r in inter)
  again = perplexity.run(cfg, wd)  # resume: nothing recomputed or appended
  assert len(again) == len(recs)
  md = open(os.path.join(wd, "perplexity.md"), encoding="utf-8").read()
  assert "rel_ppl" in md and "sweep: p" in md
  assert os.path.exists(os.path.join(wd, "perplexity_sweeps.png"))


def test_long_generation_quick(root):
  cfg = _quick("long_generation")
  wd = os.path.join(root, "long_generation")
  recs = {r["method"].split("@")[0]: r for r in long_generation.run(cfg, wd)}
  assert recs["dense"]["first_divergence"] == [cfg.new_tokens] * cfg.num_prompts
  assert recs["dense"]["edit_similarity"] == [1.0] * cfg.num_prompts
  assert recs["dense"]["kl"] == pytest.approx(0, abs=1e-5)
  for r in recs.values():
    assert all(0 <= d <= cfg.new_tokens for d in r["first_divergence"])
    assert all(0.0 <= s <= 1.0 for s in r["edit_similarity"])
    assert all(_finite(k) and k >= 0 for k in r["kl_intervals"])
  assert 0.0 <= recs["quest+track"]["overlap"] <= 1.0
  retro_rec = recs["quest+retro:w=4"]
  assert retro_rec["effective_budget_factor"] >= 1.0 - 1e-6
  # one factor per prompt, whose mean over prompts weighs each prompt alike
  assert len(retro_rec["effective_budget_prompts"]) == cfg.num_prompts
  assert all(f >= 1.0 - 1e-6 for f in retro_rec["effective_budget_prompts"])
  assert os.path.exists(os.path.join(wd, "long_generation.md"))


def _drop_records(workdir, keep):
  """Rewrites results.jsonl without the records ``keep`` rejects (a run killed early)."""
  path = os.path.join(workdir, results.RESULTS_FILE)
  recs = results.read_records(path)
  results.write_records(path, [r for r in recs if keep(r)])
  return [r for r in recs if not keep(r)]


def _unique_keys(workdir):
  keys = [r["key"] for r in results.read_records(os.path.join(workdir, results.RESULTS_FILE))]
  assert len(keys) == len(set(keys)), "duplicate rows"
  return keys


@pytest.mark.parametrize("name,module", [("perplexity", perplexity),
                                         ("long_generation", long_generation)])
def test_resume_recomputes_only_missing_rows(root, name, module):
  wd = os.path.join(root, name)
  before = _unique_keys(wd)
  dropped = _drop_records(wd, lambda r: r["method"] == "dense" or r is None)
  assert dropped
  recs = module.run(_quick(name), wd)
  assert sorted(_unique_keys(wd)) == sorted(before) and len(recs) == len(before)


def test_merge_of_a_split_run_renders_the_whole(root, tmp_path):
  wd = os.path.join(root, "accuracy")
  recs = results.read_records(os.path.join(wd, results.RESULTS_FILE))
  tasks = sorted({r["task"] for r in recs})
  halves = [[r for r in recs if (r["task"] == tasks[0]) == first] for first in (True, False)]
  assert all(halves)
  for i, half in enumerate(halves):
    os.makedirs(tmp_path / f"half{i}")
    results.write_records(str(tmp_path / f"half{i}" / results.RESULTS_FILE), half)
  into = str(tmp_path / "merged")
  added = merge.merge(into, [str(tmp_path / "half0"), str(tmp_path / "half1")])
  assert list(added.values()) == [len(halves[0]), len(halves[1])]
  assert list(merge.merge(into, [str(tmp_path / "half0")]).values()) == [0]
  assert len(results.read_records(os.path.join(into, results.RESULTS_FILE))) == len(recs)
  md = open(os.path.join(into, "accuracy.md"), encoding="utf-8").read()
  assert all(t in md for t in tasks)


def test_changed_config_never_returns_stale_records(root):
  wd = os.path.join(root, "accuracy")
  cfg = _quick("accuracy")
  before = _unique_keys(wd)
  with cfg.unlocked():
    cfg.max_new_tokens += 1  # changes every answer: the old rows must not be reused
  with pytest.raises(results.ConfigMismatch, match="max_new_tokens"):
    accuracy.run(cfg, wd)
  assert _unique_keys(wd) == before
  # A keyed sweep axis (methods) extends the workdir: only the new method's rows are computed.
  cfg = _quick("accuracy")
  with cfg.unlocked():
    cfg.methods = tuple(cfg.methods) + ("topk",)
  recs = accuracy.run(cfg, wd)
  after = _unique_keys(wd)
  assert after[:len(before)] == before
  assert {r["method"] for r in recs if r["key"] in set(after) - set(before)} == {
      f"topk@{cfg.budgets[0]:g}"}


def test_report_over_all_results(root):
  path = report.build(root, os.path.join(root, "report"))
  md = open(path, encoding="utf-8").read()
  for title in ("RULER-style accuracy", "Perplexity under sparse decoding",
                "Long generation fidelity"):
    assert f"## {title} (`" in md
  assert "no renderer" not in md
  figs = os.path.join(root, "report", "figures")
  assert sorted(os.listdir(figs)) == ["accuracy", "long_generation", "perplexity"]
  assert "Paired comparisons" in md
  for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
    assert os.path.exists(os.path.join(root, "report", link)), link
  n = sum(len(results.read_records(p)) for p in results.find_results(root))
  assert n > 0 and json.dumps(n)


def test_predictions_are_stored_whole(tmp_path, monkeypatch):
  """A record's score re-derives from its stored prediction: nothing is cut (a long answer
  used to be cut to 300 characters, so its score could not be checked from the record)."""
  from experiments.tasks import scoring
  from models import loading
  decode = loading.Model.decode
  monkeypatch.setattr(loading.Model, "decode", lambda self, ids: "x" * 400 + decode(self, ids))
  cfg = _quick("accuracy")
  with cfg.unlocked():
    cfg.methods, cfg.tasks, cfg.num_samples = ("dense",), ("niah_single_1",), 1
  recs = accuracy.run(cfg, str(tmp_path), write=False)
  assert recs and all(len(r["prediction"]) > 400 for r in recs)
  assert all(scoring.score(r["prediction"], r["answers"], r["metric"]) == r["score"]
             for r in recs)


def test_more_samples_extend_a_workdir(tmp_path):
  """``num_samples`` 1 -> 2 resumes: only the new seed's rows are computed."""
  cfg = _quick("accuracy")
  with cfg.unlocked():
    cfg.methods, cfg.tasks, cfg.num_samples = ("dense",), ("niah_single_1",), 1
  first = accuracy.run(cfg, str(tmp_path), write=False)
  with cfg.unlocked():
    cfg.num_samples = 2
  both = accuracy.run(cfg, str(tmp_path), write=False)
  assert [r["seed"] for r in first] == [0] and sorted(r["seed"] for r in both) == [0, 1]
  assert [r for r in both if r["seed"] == 0][0]["time"] == first[0]["time"]  # not rerun
