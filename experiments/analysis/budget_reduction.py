"""``experiments.budget_reduction``: the budget RESA saves at equal task accuracy (Fig. 7b).

For each family (``quest:topp``: PSA-style top-p block selection, knob = the mass threshold;
``quest:adakv``: Ada-KV head-adaptive allocation, knob = the mean budget), each knob value and
with/without ``+resa``, the RULER accuracy of one task (``experiments.tasks.accuracy``, shared
prefill, the same samples for every row) and the budget the knob really spends, measured as
the attended fraction of the context on oracle inputs of the first sample
(``experiments/analysis/errors.py``). Per family and arm, the smallest measured budget whose
accuracy is within ``tolerance`` (absolute, 2 points in the paper) of dense gives RESA's
reduction ``1 - B(+resa) / B(selector)`` (paper: up to 33.2% for top-p, 28.7% for Ada-KV).
"""

from __future__ import annotations

import collections

import numpy as np

from experiments.common import capture as capture_lib
from experiments.analysis import errors
from experiments.common import render, specs
from experiments.tasks import accuracy, ruler
from sparse_attn import methods

NAME = "budget_reduction"
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


class _Rows:
  """The sweep's rows and, lazily (only when a record is written), their measured budgets."""

  def __init__(self, config):
    self.config, self.model, self.captured, self.measured = config, None, None, {}
    self.meta = {}

  def entries(self, model) -> list[specs.Entry]:
    self.model = model
    c = self.config
    out = [specs.Entry("dense", "dense", None, methods.make("dense", block_size=c.block_size))]
    self.meta["dense"] = dict(family="dense", knob=0.0, resa=False)
    for fam in c.families:
      for knob in _knobs(c, fam):
        for resa in (False, True):
          label = f"{fam}={knob:g}" + ("+resa" if resa else "")
          out.append(specs.Entry(label, fam, None, make_method(c, fam, knob, resa)))
          self.meta[label] = dict(family=fam, knob=float(knob), resa=resa)
    return out

  def fields(self, entry) -> dict:
    if entry.label not in self.measured:
      self.measured[entry.label] = 1.0 if entry.label == "dense" else self._measure(entry.method)
    return dict(self.meta[entry.label], measured_budget=self.measured[entry.label])

  def _measure(self, method) -> float:
    c = self.config
    if self.captured is None:
      prompter = ruler.Prompter(self.model.tokenizer, chat=c.chat)
      first = ruler.generate(c.tasks[0], c.lengths[0], c.seed, prompter, 0.5, c.haystack)
      ids = prompter.ids(first.prompt)
      self.captured = (capture_lib.capture(self.model, ids, 512), len(ids) - c.budget_steps)
    cap, prefill_len = self.captured
    res = errors.simulate(method, cap.q, cap.k, cap.v, cap.scale, prefill_len, c.budget_steps)
    return float(np.nanmean(res["attended"]))


def run(config, workdir: str, mesh=None) -> list[dict]:
  rows = _Rows(config)
  records = accuracy.run(config, workdir, experiment=NAME, entries=rows.entries,
                         fields=rows.fields, write=False,
                         keyed=("families", "topp_taus", "adakv_budgets"), mesh=mesh)
  return render_all(records, workdir)


def reductions(records, tol: float) -> tuple[list[dict], list[dict]]:
  """Per (family, knob, arm): accuracy and measured budget; per family: RESA's reduction."""
  cells = collections.defaultdict(list)
  for r in records:
    cells[(r["family"], r["knob"], r["resa"])].append(r)
  dense = cells.get(("dense", 0.0, False))
  if not dense:
    return [], []
  d = float(np.mean([r["score"] for r in dense]))
  rows = []
  for (fam, knob, resa), rs in cells.items():
    if fam == "dense":
      continue
    acc = float(np.mean([r["score"] for r in rs]))
    rows.append(dict(family=fam, knob=knob, resa=resa, accuracy=100 * acc, dense=100 * d,
                     n=len(rs), measured_budget=rs[0]["measured_budget"], ok=acc >= d - tol))
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
  cfg = records[0]["config"]
  tol = cfg["tolerance"]
  rows, red = reductions(records, tol)
  if not rows:
    return []
  fig, ax = render.new_figure()
  for fam in sorted({r["family"] for r in rows}):
    for arm in (False, True):
      rs = [r for r in rows if r["family"] == fam and r["resa"] == arm]
      ax[0, 0].plot([100 * r["measured_budget"] for r in rs], [r["accuracy"] for r in rs],
                    "o-" if arm else "s--", label=fam + ("+resa" if arm else ""))
  ax[0, 0].axhline(rows[0]["dense"] - 100 * tol, color="gray", ls=":",
                   label=f"dense - {100 * tol:g} points")
  ax[0, 0].set(xlabel="measured budget (% of context)", ylabel="accuracy (%)",
               title="Fig. 7b: accuracy vs budget")
  ax[0, 0].legend(fontsize=7)
  render.save_figure(fig, workdir, "fig7b_budget_reduction.png")
  render.write_markdown(workdir, f"{NAME}.md", "Budget reduction (RESA Sec. 5.5, Fig. 7b)", [
      f"Model `{cfg['model']}`, task {', '.join(cfg['tasks'])} at "
      f"{', '.join(map(str, cfg['lengths']))} tokens, {rows[0]['n']} samples per row; RULER "
      f"accuracy (%); ok = within {100 * tol:g} points of dense.",
      render.markdown_table(rows, ["family", "knob", "resa", "measured_budget", "accuracy",
                                   "dense", "n", "ok"]),
      render.markdown_table(red, ["family", "budget_base", "budget_resa", "reduction",
                                  "paper"]),
      "![Fig. 7b](fig7b_budget_reduction.png)"])
  return red
