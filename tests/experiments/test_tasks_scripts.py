"""Each task experiment's ``--config.quick=True`` run on tiny-random, then the report over all.

Runs in-process (the jit caches are shared across the scripts); numbers of a random model
mean nothing, so the checks are: outputs exist, values are finite and in range, resume works.
"""

import json
import math
import os

import pytest

from experiments.common import results
from experiments.tasks import accuracy, config_util, long_generation, perplexity, report


def _quick(name):
  module = __import__(f"configs.{name}", fromlist=["get_config"])
  c = module.get_config()
  with c.unlocked():
    c.quick = True
  return config_util.resolve(c, name)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  return str(tmp_path_factory.mktemp("results"))


def _finite(x):
  return isinstance(x, (int, float)) and math.isfinite(x)


def test_accuracy_quick_and_resume(root):
  cfg = _quick("accuracy")
  wd = os.path.join(root, "accuracy")
  recs = accuracy.run(cfg, wd)
  n_methods = len(cfg.methods)
  assert len(recs) == n_methods * len(cfg.tasks) * len(cfg.lengths) * cfg.num_samples
  assert all(0.0 <= r["score"] <= 1.0 and r["model"] == "tiny-random" for r in recs)
  assert all(abs(r["num_tokens"] - r["length"]) <= 0.02 * r["length"] for r in recs)
  assert all(r["new_tokens"] <= cfg.max_new_tokens and "git" in r for r in recs)
  md = open(os.path.join(wd, "accuracy.md"), encoding="utf-8").read()
  assert "tiny-random" in md and md.index("| dense |") < md.index("| quest")
  assert os.path.exists(os.path.join(wd, "accuracy_vs_length.png"))
  again = accuracy.run(cfg, wd)  # resume: everything done, nothing appended
  assert len(again) == len(recs)


def test_perplexity_quick(root):
  cfg = _quick("perplexity")
  wd = os.path.join(root, "perplexity")
  recs = perplexity.run(cfg, wd)
  tail = [r for r in recs if r["view"] == "tail"]
  inter = [r for r in recs if r["view"] == "interval"]
  assert {r["method"] for r in tail} >= {"dense", "quest:p=0.2", "quest:p=0.2+rect:f=4"}
  assert all(_finite(r["nll"]) and _finite(r["kl"]) and r["kl"] >= 0 for r in recs)
  dense = [r for r in tail if r["method"] == "dense"][0]
  assert dense["kl"] == pytest.approx(0.0, abs=1e-5) and dense["agree"] == 1.0
  assert inter and all(len(r["nll_intervals"]) == (cfg.interval_length // 2) // cfg.interval
                       for r in inter)
  md = open(os.path.join(wd, "perplexity.md"), encoding="utf-8").read()
  assert "rel_ppl" in md and "sweep: p" in md
  assert os.path.exists(os.path.join(wd, "perplexity_sweeps.png"))


def test_long_generation_quick(root):
  cfg = _quick("long_generation")
  wd = os.path.join(root, "long_generation")
  recs = {r["method"].split("@")[0]: r for r in long_generation.run(cfg, wd)}
  assert recs["dense"]["first_divergence"] == [cfg.new_tokens]
  assert recs["dense"]["edit_similarity"] == [1.0] and recs["dense"]["kl"] == pytest.approx(0, abs=1e-5)
  for r in recs.values():
    assert all(0 <= d <= cfg.new_tokens for d in r["first_divergence"])
    assert all(0.0 <= s <= 1.0 for s in r["edit_similarity"])
    assert all(_finite(k) and k >= 0 for k in r["kl_intervals"])
  assert 0.0 <= recs["quest+track"]["overlap"] <= 1.0
  assert recs["quest+retro:w=4"]["effective_budget_factor"] >= 1.0 - 1e-6
  assert os.path.exists(os.path.join(wd, "long_generation.md"))


def test_report_over_all_results(root):
  path = report.build(root, os.path.join(root, "report"))
  md = open(path, encoding="utf-8").read()
  for title in ("RULER-style accuracy", "Perplexity under sparse decoding",
                "Long-generation fidelity"):
    assert f"## {title}" in md
  figs = os.path.join(root, "report", "figures")
  assert sorted(os.listdir(figs)) == ["accuracy", "long_generation", "perplexity"]
  n = sum(len(results.read_records(p)) for p in results.find_results(root))
  assert n > 0 and json.dumps(n)
