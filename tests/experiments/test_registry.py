"""One registration per experiment: a toy experiment with a claim row, added to a temporary
registry, shows in reproduce's plan, the per-experiment report and the claims report."""

import json
import os
import sys
import types

from experiments import registry, report, reproduce
from experiments.claims import report as claims_report
from experiments.claims import row as claims_row


def _toy_module():
  """A module with the three functions a registration names (run, render, measure)."""
  mod = types.ModuleType("toy_experiment_for_test")

  def render(records, workdir):
    with open(os.path.join(workdir, "toy.md"), "w", encoding="utf-8") as f:
      f.write(f"# Toy experiment\n\n{len(records)} toy records\n")

  def measure(records):
    hits = [r["hit"] for r in records]
    return claims_row.Measured(ours=f"{sum(hits)}/{len(hits)}", n=len(hits),
                               setting="toy setting", why="toy why",
                               verdict="reproduced" if all(hits) else "not reproduced")

  mod.run, mod.render, mod.measure = None, render, measure
  return mod


def test_a_toy_experiment_is_seen_by_reproduce_report_and_claims(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "toy_experiment_for_test", _toy_module())
  toy = registry.Experiment(
      "toy", "toy_experiment_for_test:run", "toy_experiment_for_test:render", "toy.md",
      (registry.Part("toy_part", 3, (registry.Claim(
          "toys are always found", "Toy Table 1", "100%", "", "toy_experiment_for_test:measure"),
      )),))
  experiments = registry.EXPERIMENTS + (toy,)

  assert reproduce.plan(["toy_part"], experiments=experiments) == [("toy_part", "toy")]
  assert reproduce.command("toy_part", "toy", "out")[1:4] == ["-m", "experiments", "toy"]
  assert reproduce.eta_line(0, [("toy_part", "toy")], 0.0, {}, experiments).endswith(
      "eta 3.0 min")

  (tmp_path / "toy_part").mkdir()
  with open(tmp_path / "toy_part" / "results.jsonl", "w", encoding="utf-8") as f:
    for hit in (True, True):
      f.write(json.dumps(dict(experiment="toy", hit=hit, git="abc", config={})) + "\n")
  md = open(report.build(str(tmp_path), experiments=experiments), encoding="utf-8").read()
  assert "## Toy experiment (`toy_part/results.jsonl`)" in md and "2 toy records" in md

  claims = open(claims_report.build(str(tmp_path), experiments=experiments),
                encoding="utf-8").read()
  row = next(ln for ln in claims.splitlines() if "toys are always found" in ln)
  assert "2/2" in row and "reproduced" in row and "Toy Table 1" in row
  # the default registry knows nothing of it: its records are listed, never dropped
  assert "no renderer" in open(report.build(str(tmp_path)), encoding="utf-8").read()


def test_unknown_names_are_one_clear_error():
  try:
    registry.get("acuracy")
  except ValueError as e:
    assert "unknown experiment 'acuracy'" in str(e) and "accuracy" in str(e)
  else:
    raise AssertionError("no error")
