"""``experiments.resa_lambda``: quality vs RESA's lambda per task (Fig. 7a).

Records: ``dense`` per task, then one per (task, lambda) with the mean NLL per scored token,
the token count and the quality relative to dense. ``lambda = 0`` is the selector alone.
"""

from __future__ import annotations

import numpy as np

from experiments.analysis import quality
from experiments.common import cli, modelzoo, render
from experiments.common.results import ResultWriter
from sparse_attn import methods

NAME = "resa_lambda"
KEYED = ("tasks", "lambdas")  # in every record's key


def run(config, workdir: str) -> list[dict]:
  writer = ResultWriter(workdir, config, NAME, keyed=KEYED)
  jobs = [(t, None) for t in config.tasks] + [(t, lam) for t in config.tasks
                                              for lam in config.lambdas]
  todo = [(t, lam) for t, lam in jobs if not writer.done(_key(t, lam))]
  if todo:
    model = modelzoo.load_model(config.model)
    items = {t: quality.samples(model, t, config.samples, config.ctx, config.cont, config.seed)
             for t in config.tasks}
    prog = cli.Progress(len(todo) * config.samples, "nll", every=10.0)
    for task, lam in todo:
      if lam is None:
        m = methods.make("dense", block_size=config.block_size)
      else:
        m = methods.make(config.method, budget=config.budget, block_size=config.block_size,
                         lam=float(lam))
      res = quality.nll(model, m, items[task], prog)
      writer.write(dict(task=task, lam=lam, spec=m.spec, budget=config.budget, **res),
                   key=_key(task, lam))
  return render_all(writer.records(), workdir)


def _key(task, lam):
  return f"{task}/dense" if lam is None else f"{task}/lam={lam:g}"


def table(records) -> list[dict]:
  dense = {r["task"]: r["nll"] for r in records if r["lam"] is None}
  rows = []
  for r in sorted((r for r in records if r["lam"] is not None),
                  key=lambda r: (r["task"], r["lam"])):
    d = dense.get(r["task"])
    rows.append(dict(task=r["task"], lam=r["lam"], nll=r["nll"], dense_nll=d,
                     quality=quality.relative_quality(r["nll"], d) if d is not None else np.nan,
                     tokens=r["tokens"]))
  return rows


def render_all(records, workdir: str) -> list[dict]:
  rows = table(records)
  if not rows:
    return rows
  fig, ax = render.new_figure()
  for task in sorted({r["task"] for r in rows}):
    rs = [r for r in rows if r["task"] == task]
    ax[0, 0].plot([r["lam"] for r in rs], [r["quality"] for r in rs], "o-", label=task)
  ax[0, 0].axhline(1.0, color="gray", ls="--", label="dense")
  cfg = records[0]["config"]
  ax[0, 0].set(xlabel="lambda", ylabel="quality exp(-(NLL - NLL_dense))",
               title=f"Fig. 7a: {cfg['method']} @ {cfg['budget']:g} vs lambda")
  ax[0, 0].legend(fontsize=7)
  render.save_figure(fig, workdir, "fig7a_lambda_sweep.png")
  best = []
  for task in sorted({r["task"] for r in rows}):
    rs = [r for r in rows if r["task"] == task]
    b = max(rs, key=lambda r: r["quality"])
    best.append(f"{task}: best lambda {b['lam']:g} (quality {b['quality']:.4f}; lambda=0 "
                f"{next((r['quality'] for r in rs if r['lam'] == 0), float('nan')):.4f})")
  render.write_markdown(workdir, f"{NAME}.md", "RESA lambda sweep (RESA Sec. 5.4, Fig. 7a)", [
      f"Model {cfg['model']}, {cfg['method']} at budget {cfg['budget']:g}, {cfg['samples']} "
      f"samples per task, prompt {cfg['ctx']} tokens; teacher-forced NLL per scored token. "
      "quality = exp(-(NLL - NLL_dense)).",
      render.markdown_table(rows, ["task", "lam", "nll", "dense_nll", "quality", "tokens"]),
      "\n".join(f"- {b}" for b in best)])
  return rows
