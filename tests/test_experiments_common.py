"""Experiment plumbing: JSONL append/resume, data files present, markdown rendering."""

import json

from experiments.common import data, render, results


def test_results_append_resume_and_truncated_line(tmp_path):
  cfg = {"model": "tiny", "budgets": [0.1, 0.2]}
  w = results.ResultWriter(str(tmp_path), cfg, "demo")
  w.write({"nll": 1.5}, key="a")
  assert w.done("a") and not w.done("b")
  with open(w.path, "a") as f:
    f.write('{"experiment": "demo", "key": "b", "nl')  # a run killed mid-write
  w2 = results.ResultWriter(str(tmp_path), cfg, "demo")
  assert w2.done("a") and not w2.done("b")
  rec = w2.write({"nll": float("inf")}, key="b")
  assert rec["config"] == {"model": "tiny", "budgets": [0.1, 0.2]} and rec["git"]
  assert [r["key"] for r in w2.records()] == ["a", "b"]
  assert json.loads(open(w.path).read().splitlines()[-1])["nll"] == "inf"


def test_vendored_data_is_real_text():
  assert "Elizabeth" in data.austen("prideprejudice")
  assert len(data.long_text("austen")) > 3_000_000
  qa = data.squad()
  assert len(qa) > 10_000 and all(a in qa[0]["context"] for a in qa[0]["answers"])
  assert "startup" in data.paul_graham_essays().lower()


def test_markdown_table():
  md = render.markdown_table([{"a": 1, "b": 0.123456}], ["a", "b"])
  assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.1235 |"]
