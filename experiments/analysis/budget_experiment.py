"""``experiments.budget_reduction``: the budget RESA saves at equal quality (Fig. 7b).

For each family (``quest:topp``, ``quest:adakv``), each knob value and with/without ``+resa``:
the measured budget (mean attended fraction on oracle inputs of the first sample) and the
teacher-forced NLL. The smallest measured budget whose quality is within ``tolerance`` of dense,
per family and arm, gives RESA's reduction ``1 - B(+resa) / B(selector)`` (paper: up to 33.2%
for top-p, 28.7% for Ada-KV).
"""

from __future__ import annotations

import numpy as np

from experiments.analysis import capture as capture_lib
from experiments.analysis import errors, quality
from experiments.common import cli, modelzoo, render
from experiments.common.results import ResultWriter
from sparse_attn import methods

NAME = "budget_reduction"
KEYED = ("families", "topp_taus", "adakv_budgets")  # in every record's key
PAPER = {"quest:topp": "33.2%", "quest:adakv": "28.7%"}


def make_method(config, family: str, knob: float, resa: bool):
  """``quest:topp`` -> ``make("quest", topp=tau, budget=cap)``; ``quest:adakv`` ->
  ``make("quest", adakv=floor, budget=knob)``; ``+resa`` appended when ``resa``."""
  base, _, rule = family.partition(":")
  spec = base + (f"+resa:{config.resa_options}" if resa else "")
  if rule == "topp":
    return methods.make(spec, topp=float(knob), budget=float(config.topp_cap),
                        block_size=config.block_size)
  if rule == "adakv":
    return methods.make(spec, adakv=float(config.adakv_floor), budget=float(knob),
                        block_size=config.block_size)
  raise ValueError(f"unknown family {family!r}; valid: quest:topp, quest:adakv")


def _knobs(config, family):
  return config.topp_taus if family.endswith("topp") else config.adakv_budgets


def run(config, workdir: str) -> list[dict]:
  writer = ResultWriter(workdir, config, NAME, keyed=KEYED, ignore=("tolerance",))
  jobs = [("dense", 0.0, False)] + [(f, k, r) for f in config.families for k in _knobs(config, f)
                                    for r in (False, True)]
  todo = [j for j in jobs if not writer.done(_key(*j))]
  if todo:
    model = modelzoo.load_model(config.model)
    items = quality.samples(model, config.task, config.samples, config.ctx, config.cont,
                            config.seed)
    first = items[0]
    cap = capture_lib.capture(model, first.tokens[:first.prefill_len + config.budget_steps],
                              512)
    prog = cli.Progress(len(todo) * config.samples, "nll", every=10.0)
    for family, knob, resa in todo:
      if family == "dense":
        m, measured = methods.make("dense", block_size=config.block_size), 1.0
      else:
        m = make_method(config, family, knob, resa)
        res = errors.simulate(m, cap.q, cap.k, cap.v, cap.scale, first.prefill_len,
                              config.budget_steps)
        measured = float(np.nanmean(res["attended"]))
      out = quality.nll(model, m, items, prog)
      writer.write(dict(family=family, knob=knob, resa=resa, spec=m.spec, measured_budget=measured,
                        **out), key=_key(family, knob, resa))
  return render_all(writer.records(), workdir)


def _key(family, knob, resa):
  return f"{family}/{knob:g}/{'resa' if resa else 'base'}"


def reductions(records, tol: float) -> tuple[list[dict], list[dict]]:
  dense = next((r["nll"] for r in records if r["family"] == "dense"), None)
  rows = []
  for r in records:
    if r["family"] == "dense" or dense is None:
      continue
    q = quality.relative_quality(r["nll"], dense)
    rows.append(dict(family=r["family"], knob=r["knob"], resa=r["resa"], nll=r["nll"],
                     quality=q, measured_budget=r["measured_budget"], ok=q >= 1.0 - tol))
  rows.sort(key=lambda r: (r["family"], r["resa"], r["measured_budget"]))
  red = []
  for fam in sorted({r["family"] for r in rows}):
    best = {}
    for arm in (False, True):
      ok = [r["measured_budget"] for r in rows if r["family"] == fam and r["resa"] == arm
            and r["ok"]]
      best[arm] = min(ok) if ok else float("nan")
    red.append(dict(family=fam, budget_base=best[False], budget_resa=best[True],
                    reduction=1.0 - best[True] / best[False], paper=PAPER.get(fam, "")))
  return rows, red


def render_all(records, workdir: str) -> list[dict]:
  if not records:
    return []
  tol = records[0]["config"]["tolerance"]
  rows, red = reductions(records, tol)
  if not rows:
    return []
  fig, ax = render.new_figure()
  for fam in sorted({r["family"] for r in rows}):
    for arm in (False, True):
      rs = [r for r in rows if r["family"] == fam and r["resa"] == arm]
      ax[0, 0].plot([100 * r["measured_budget"] for r in rs], [r["quality"] for r in rs],
                    "o-" if arm else "s--", label=fam + ("+resa" if arm else ""))
  ax[0, 0].axhline(1.0 - tol, color="gray", ls=":", label=f"dense - {100 * tol:g}%")
  ax[0, 0].set(xlabel="measured budget (% of context)", ylabel="quality vs dense",
               title="Fig. 7b: quality vs budget")
  ax[0, 0].legend(fontsize=7)
  render.save_figure(fig, workdir, "fig7b_budget_reduction.png")
  cfg = records[0]["config"]
  render.write_markdown(workdir, f"{NAME}.md", "Budget reduction (RESA Sec. 5.5, Fig. 7b)", [
      f"Model {cfg['model']}, task {cfg['task']}, {cfg['samples']} samples, prompt {cfg['ctx']}"
      f" tokens; quality = exp(-(NLL - NLL_dense)); within {100 * tol:g}% of dense = ok.",
      render.markdown_table(rows, ["family", "knob", "resa", "measured_budget", "nll",
                                   "quality", "ok"]),
      render.markdown_table(red, ["family", "budget_base", "budget_resa", "reduction",
                                  "paper"])])
  return red
