"""``experiments.resa_lambda``: task accuracy vs RESA's lambda (RESA Sec. 5.4, Fig. 7a).

Rows (``experiments.tasks.accuracy`` on RULER tasks, one shared prefill per batch): dense,
then ``config.method`` at ``config.budget`` for every lambda and each form of the prior weight
(``lam_form``: ``renormalised``, this library's default, and ``literal``, the paper's
``alpha' = lam * alpha``; the two agree at lambda = 0 and 1, so those run once). Lambda = 0 is
the selector alone. Every record is an accuracy record plus ``lam`` and ``lam_form``; the
figure is accuracy vs lambda per task (the paper: rising for retrieval, falling for CWE-like
aggregation).
"""

from __future__ import annotations

import collections

import numpy as np

from experiments.common import render, specs
from experiments.tasks import accuracy, accuracy_report

NAME = "resa_lambda"
FORMS = ("renormalised", "literal")


def entries(config, model) -> list[specs.Entry]:
  """Dense, then one row per (lambda, form); forms coincide at lambda 0 and 1."""
  opts = dict(block_size=config.block_size, model=model)
  out = [specs.Entry("dense", "dense", None, specs.build("dense", **opts))]
  for lam in config.lambdas:
    for form in (FORMS[:1] if lam in (0.0, 1.0) else FORMS):
      label = f"{config.method}@{config.budget:g} lam={lam:g}" + (
          f" {form}" if lam not in (0.0, 1.0) else "")
      m = specs.build(config.method, config.budget, lam=float(lam), lam_form=form, **opts)
      out.append(specs.Entry(label, config.method, config.budget, m))
  return out


def _fields(entry) -> dict:
  m = entry.method
  resa = None if entry.label == "dense" else m.resa
  return dict(lam=resa.lam if resa else None, lam_form=resa.lam_form if resa else None)


def run(config, workdir: str, mesh=None) -> list[dict]:
  records = accuracy.run(config, workdir, experiment=NAME, fields=_fields, write=False,
                         entries=lambda model: entries(config, model), keyed=("lambdas",),
                         mesh=mesh)
  return render_all(records, workdir)


def table(records) -> list[dict]:
  """Mean accuracy per (task, lambda, form), with dense per task."""
  cells = collections.defaultdict(list)
  for r in records:
    cells[(r["task"], r.get("lam"), r.get("lam_form"))].append(r["score"])
  dense = {t: np.mean(v) for (t, lam, _), v in cells.items() if lam is None}
  rows = []
  for (task, lam, form), v in sorted(cells.items(), key=lambda kv: (
      kv[0][0], -1 if kv[0][1] is None else kv[0][1], str(kv[0][2]))):
    c = accuracy_report.cell(v)
    rows.append(dict(task=task, lam="dense" if lam is None else lam, form=form or "",
                     accuracy=100 * c["mean"], lo=100 * c["lo"], hi=100 * c["hi"], n=c["n"],
                     vs_dense=100 * (c["mean"] - dense[task]) if task in dense else ""))
  return rows


def render_all(records, workdir: str) -> list[dict]:
  rows = table(records)
  if not rows:
    return rows
  fig, ax = render.new_figure()
  for task in sorted({r["task"] for r in rows}):
    for form in FORMS:
      rs = sorted((r for r in rows if r["task"] == task and r["lam"] != "dense"
                   and r["form"] in (form, FORMS[0]) and (r["form"] == form or
                                                           r["lam"] in (0.0, 1.0))),
                  key=lambda r: r["lam"])
      if len(rs) > 1:
        ax[0, 0].plot([r["lam"] for r in rs], [r["accuracy"] for r in rs],
                      "o-" if form == FORMS[0] else "s--", label=f"{task} ({form})")
  cfg = records[0]["config"]
  ax[0, 0].set(xlabel="lambda", ylabel="accuracy (%)",
               title=f"Fig. 7a: {cfg['method']} @ {cfg['budget']:g} vs lambda")
  ax[0, 0].legend(fontsize=6)
  render.save_figure(fig, workdir, "fig7a_lambda_sweep.png")
  render.write_markdown(workdir, f"{NAME}.md", "RESA lambda sweep (RESA Sec. 5.4, Fig. 7a)", [
      f"Model `{cfg['model']}`, {cfg['method']} at budget {cfg['budget']:g}, context "
      f"{', '.join(map(str, cfg['lengths']))} tokens, RULER string-match accuracy (%) with 95% "
      "Wilson intervals; vs_dense in points. renormalised: this library's prior weight; "
      "literal: the paper's alpha' = lam * alpha.",
      render.markdown_table(rows, ["task", "lam", "form", "accuracy", "lo", "hi", "n",
                                   "vs_dense"]),
      "![Fig. 7a](fig7a_lambda_sweep.png)"])
  return rows
