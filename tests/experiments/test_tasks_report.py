"""``experiments.tasks.accuracy_report``: paired comparisons pair the same samples at the same
budget, and the task tables group by protocol."""

import numpy as np
import pytest

from experiments.common import stats
from experiments.tasks import accuracy_report


def _rec(spec, budget, seed, score, task="vt", protocol="query_aware", length=4096):
  label = spec if budget is None else f"{spec}@{budget:g}"
  return dict(model="m", protocol=protocol, method=label, spec=spec, budget=budget, task=task,
              length=length, seed=seed, depth=0.5, score=score,
              config=dict(pairs=[["resa-quest", "quest"]]))


def test_paired_rows_use_only_shared_samples_at_equal_budget():
  rng = np.random.default_rng(0)
  a = rng.integers(0, 2, 40).astype(float)
  b = rng.integers(0, 2, 40).astype(float)
  recs = [_rec("resa-quest", 0.025, i, a[i]) for i in range(40)]
  recs += [_rec("quest", 0.025, i, b[i]) for i in range(35)]  # 5 samples not run by quest
  recs += [_rec("quest", 0.05, i, 1.0) for i in range(40)]  # another budget: never paired
  recs += [_rec("quest", 0.025, i, 0.0, protocol="query_agnostic") for i in range(40)]
  (row,) = accuracy_report.paired_rows(recs)
  assert row["n"] == 35 and row["budget"] == 0.025 and row["protocol"] == "query_aware"
  diff, lo, hi = stats.paired_bootstrap(a[:35], b[:35])
  assert row["diff"] == pytest.approx(100 * diff) and row["lo"] == pytest.approx(100 * lo)
  assert row["acc_a"] == pytest.approx(100 * a[:35].mean())
  assert row["mcnemar_p"] == pytest.approx(stats.mcnemar(a[:35], b[:35]))
  md = accuracy_report.paired_section(recs)
  assert "resa-quest | quest | 0.025 | 35" in md


def test_partial_credit_scores_have_no_mcnemar_and_tables_split_protocols():
  recs = [_rec("resa-quest", 0.025, i, 0.5) for i in range(4)]
  recs += [_rec("quest", 0.025, i, 0.25) for i in range(4)]
  (row,) = accuracy_report.paired_rows(recs)
  assert row["mcnemar_p"] == "" and row["diff"] == pytest.approx(25.0)
  recs += [_rec("quest", 0.025, i, 1.0, protocol="query_agnostic") for i in range(4)]
  tables = accuracy_report.tables(recs)
  assert len(tables) == 2 and sum("compressed before the question" in t for t in tables) == 1
