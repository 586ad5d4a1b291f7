r"""The reproduction report: each paper claim next to what this library measures.

  python -m experiments.claims --workdir=results     # writes results/REPORT.md

Reads every ``WORKDIR/*/results.jsonl`` (the committed records), measures each claim of
``experiments.claims_table.CLAIMS`` on them, and writes ``WORKDIR/REPORT.md``: the claims table
(paper's number, ours with an interval and the sample count, setting, verdict and why, the figure
that shows it), the leaderboard (``experiments.claims_table.leaderboard``), the measured wall time
of every part (``WORKDIR/timings.jsonl``), and the per-experiment report
(``experiments.report``). A claim whose experiment has no records yet is listed as "not run",
never dropped.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from experiments import claims_table
from experiments.common import render, results

FLAGS = flags.FLAGS
COLUMNS = ("claim", "source", "paper", "ours", "n", "setting", "verdict", "why", "figure")


def load(root: str) -> dict[str, list[dict]]:
  """experiment name -> its records, from every ``results.jsonl`` under ``root``."""
  out: dict[str, list[dict]] = {}
  for path in sorted(results.find_results(root)):
    for r in results.read_records(path):
      out.setdefault(r.get("experiment", "unknown"), []).append(r)
  return out


def claim_rows(records: dict[str, list[dict]], root: str) -> list[dict]:
  rows = []
  for c in claims_table.CLAIMS:
    recs = records.get(c.experiment, [])
    got = c.measure(recs) if recs else None
    row = dict(claim=c.claim, source=c.source, paper=c.paper)
    if got is None:
      why = (f"the `{c.experiment}` records hold no rows for this claim yet" if recs
             else f"no `{c.experiment}` records under `{root}` yet")
      row.update(ours="-", n=0, setting="-", verdict="not run", why=why, figure="")
    else:
      fig = os.path.normpath(os.path.join(c.experiment, c.figure)) if c.figure else ""
      row.update(got, figure=f"[{os.path.basename(fig)}]({fig})" if fig and os.path.exists(
          os.path.join(root, fig)) else "")
    rows.append(row)
  return rows


def timings(root: str) -> list[dict]:
  """Last wall time per part from ``timings.jsonl`` (written by ``experiments.reproduce``)."""
  path = os.path.join(root, "timings.jsonl")
  if not os.path.exists(path):
    return []
  last = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        last[r["part"]] = dict(part=r["part"], minutes=round(r["seconds"] / 60, 1), rc=r["rc"],
                               finished=r["finished"])
  return list(last.values())


def build(root: str) -> str:
  """Writes ``root/REPORT.md``; returns its path."""
  records = load(root)
  rows = claim_rows(records, root)
  verdicts = {v: sum(r["verdict"] == v for r in rows)
              for v in ("reproduced", "partly", "not reproduced", "not run")}
  sections = [
      "Every number below is computed from the committed `*/results.jsonl` by "
      "`python -m experiments.claims --workdir=results`; intervals are 95% bootstrap intervals "
      "(paired where two methods ran on the same samples) or Wilson intervals for accuracies. "
      "Verdict rules are in `experiments/claims_table.py`, one per claim.",
      "Verdicts: " + ", ".join(f"{v} {n}" for v, n in verdicts.items()) + ".",
      "## Claims\n\n" + render.markdown_table(rows, COLUMNS)]
  board = claims_table.leaderboard(records.get("accuracy", []))
  if board:
    sections.append("## Leaderboard (RULER-style accuracy)\n\n" + board)
  t = timings(root)
  if t:
    total = sum(r["minutes"] for r in t)
    sections.append(f"## Wall time on this machine (2 CPU cores): {total:.0f} min in all\n\n"
                    + render.markdown_table(t, ["part", "minutes", "rc", "finished"]))
  sections.append("Per-experiment tables and figures: each folder's markdown (e.g. "
                  "`svd_analysis/svd_analysis.md`) and `report.md` (`python -m experiments.report"
                  " --workdir=results`).")
  return render.write_markdown(root, "REPORT.md", "Reproduction report", sections)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not os.path.isdir(FLAGS.workdir):
    raise app.UsageError(f"--workdir={FLAGS.workdir} is not a directory")
  print(open(build(FLAGS.workdir), encoding="utf-8").read())


if __name__ == "__main__":
  flags.DEFINE_string("workdir", "results", "Root holding one folder per experiment.")
  app.run(main)
