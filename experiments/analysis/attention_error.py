"""``experiments.attention_error``: per-layer x head attention error (Fig. 6a) + summary.

One record per (method spec, budget): ``[L, N]`` arrays (means over the decode steps) of
``out_rel_l2``, ``score_l1``, ``score_rel_l2``, ``attended`` (and ``out_rel_l2_retired`` for
RetroAttention); ``+resa`` records also hold RESA's error split into its mass and value estimates
(``resa_decomposition.HEAD_FIELDS``). The summary pairs every selector with its ``+resa`` twin and
reports the error reduction ``1 - err(+resa) / err(selector)`` and that split.
"""

from __future__ import annotations

import numpy as np

from experiments.common import capture as capture_lib
from experiments.analysis import errors, resa_decomposition
from experiments.common import cli, modelzoo, render
from experiments.common.results import ResultWriter
from sparse_attn import methods

NAME = "attention_error"
KEYED = ("selectors", "budgets", "resa_options", "extra", "extra_budgets")  # in every key
PAPER_REDUCTION = "55-77% (score error, 5% budget)"
METRICS = ("score_l1", "score_rel_l2", "out_rel_l2")


def method_list(config) -> list[tuple[str, float]]:
  """``(spec, budget)`` pairs: every selector with and without ``+resa``, then the extras."""
  resa = "+resa" + (f":{config.resa_options}" if config.resa_options else "")
  out = [(s + suffix, b) for b in config.budgets for s in config.selectors
         for suffix in ("", resa)]
  out += [(s, b) for b in config.extra_budgets for s in config.extra]
  return out


def run(config, workdir: str) -> list[dict]:
  writer = ResultWriter(workdir, config, NAME, keyed=KEYED, ignore=("heatmap_budget",))
  todo = [(s, b) for s, b in method_list(config) if not writer.done(f"{s}@{b}")]
  if todo:
    model = modelzoo.load_model(config.model)
    n = config.prefill_len + config.steps
    tokens = capture_lib.text_tokens(model, config.text, n, config.skip_chars)
    cap = capture_lib.capture(model, tokens, config.chunk,
                              cli.Progress(-(-n // config.chunk), "capture"))
    prog = cli.Progress(len(todo), "methods", every=1.0)
    for spec, budget in todo:
      m = methods.make(spec, budget=budget, block_size=config.block_size)
      decomp, res = resa_decomposition.split(
          errors.simulate(m, cap.q, cap.k, cap.v, cap.scale, config.prefill_len, config.steps,
                          chunk=config.chunk))
      rec = dict(spec=spec, budget=budget, selector=m.name, resa=bool(m.resa),
                 lam=m.resa.lam if m.resa else None, retro_w=m.window,
                 rect_f=m.rect_interval, prefill_len=config.prefill_len,
                 steps=config.steps)
      rec.update({k: np.nanmean(v, axis=1) if np.isfinite(v).any() else np.full(
          v.shape[::2], np.nan) for k, v in res.items()})
      rec.update(decomp)  # [L, N] per head (RESA specs whose output is a merge)
      writer.write(rec, key=f"{spec}@{budget}")
      prog.update(note=f"{spec}@{budget}")
  return render_all(writer.records(), workdir)


def _mean(rec, name):
  x = np.asarray(rec.get(name, np.nan), np.float64)
  return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def head_reduction_quantiles(base, resa) -> dict:
  """The paper's Fig. 6a statistic: per head, the layers' average score error, and RESA's
  reduction ``1 - err_resa / err_base`` of it; quantiles over heads (RESA Sec. 5.3: "for almost
  all heads ... about 55%-70%").

  Args:
    base, resa: ``[L, H]`` per layer x head ``score_l1`` of the selector and of ``+resa``.

  Returns:
    dict of ``head_reduction_{q10,q25,median,q75,q90}`` and ``heads_reduced`` (fraction of
    heads whose error RESA lowers).
  """
  b = np.nanmean(np.asarray(base, np.float64), axis=0)  # [H] layers' average
  r = np.nanmean(np.asarray(resa, np.float64), axis=0)
  ok = b > 0
  red = 1.0 - r[ok] / b[ok]
  if not red.size:
    return {f"head_reduction_{k}": float("nan") for k in ("q10", "q25", "median", "q75", "q90")}
  q = np.quantile(red, [0.1, 0.25, 0.5, 0.75, 0.9])
  return dict(zip(("head_reduction_q10", "head_reduction_q25", "head_reduction_median",
                   "head_reduction_q75", "head_reduction_q90"), map(float, q)),
              heads_reduced=float(np.mean(red > 0)))


def summary(records) -> tuple[list[dict], list[dict]]:
  """``(rows per method, RESA reduction rows per selector and budget)``."""
  rows = []
  for r in records:
    rows.append(dict(spec=r["spec"], budget=r["budget"], attended=_mean(r, "attended"),
                     **{m: _mean(r, m) for m in METRICS + ("out_rel_l2_retired",)}))
  red = []
  raw = {(r["spec"], r["budget"]): r for r in records}
  by = {(r["spec"], r["budget"]): r for r in rows}
  for r in rows:
    spec = r["spec"]
    if "+" in spec:
      continue
    twins = [t for (s, b), t in by.items() if b == r["budget"] and s.startswith(spec + "+resa")
             and s.count("+") == 1]
    for t in twins:
      row = dict(selector=spec, resa=t["spec"], budget=r["budget"])
      for m in METRICS:
        row[f"{m}_base"], row[f"{m}_resa"] = r[m], t[m]
        row[f"{m}_reduction"] = 1.0 - t[m] / r[m] if r[m] > 0 else float("nan")
      row.update(head_reduction_quantiles(raw[spec, r["budget"]]["score_l1"],
                                          raw[t["spec"], r["budget"]]["score_l1"]))
      row.update(resa_decomposition.summarise(raw[t["spec"], r["budget"]]))
      red.append(row)
  return rows, red


def render_all(records, workdir: str) -> list[dict]:
  if not records:
    return []
  rows, red = summary(records)
  _fig6a_heatmaps(records, workdir)
  if red:
    _fig6a_reduction(red, workdir)
  prefill = records[0]["prefill_len"]
  steps = records[0]["steps"]
  sections = [
      f"Oracle-input per-layer errors vs dense attention: prompt {prefill} tokens, {steps} "
      "decode steps, means over steps, layers and heads. `score_l1` = sum_j |a_j - a*_j| of the "
      "attention distribution (RESA's implied distribution for `+resa`), `score_rel_l2` = "
      "||a - a*|| / ||a*||, `out_rel_l2` = ||o - o*|| / ||o*||. `+rect` is a no-op under "
      "oracle inputs (nothing to rectify); `+retro`'s newest output equals its selector's, "
      "`out_rel_l2_retired` is the window's oldest output after its retrospective updates.",
      render.markdown_table(rows, ["spec", "budget", "attended", *METRICS, "out_rel_l2_retired"])]
  if red:
    sections += [f"RESA's error reduction (paper: {PAPER_REDUCTION}):",
                 render.markdown_table(red, ["selector", "resa", "budget", "head_reduction_q25",
                                             "head_reduction_median", "head_reduction_q75",
                                             "heads_reduced"]
                                       + [f"{m}_reduction" for m in METRICS])]
  decomp = [r for r in red if "source" in r]
  if decomp:
    sections += [resa_decomposition.TABLE_NOTE,
                 render.markdown_table(decomp, list(resa_decomposition.TABLE_COLUMNS))]
  render.write_markdown(workdir, f"{NAME}.md", "Attention error (RESA Sec. 5.3, Fig. 6a)",
                        sections)
  return red


def _fig6a_heatmaps(records, workdir):
  budget = records[0]["config"]["heatmap_budget"]
  recs = [r for r in records if r["budget"] == budget and "+" not in r["spec"]]
  by = {r["spec"]: r for r in records if r["budget"] == budget}
  for r in recs:
    twin = next((by[s] for s in by if s.startswith(r["spec"] + "+resa") and s.count("+") == 1),
                None)
    if twin is None:
      continue
    base, res = np.asarray(r["score_l1"]), np.asarray(twin["score_l1"])
    vmax = float(np.nanmax(base))
    fig, ax = render.new_figure(2, size=(4.0, 5.0))
    for i, (name, grid) in enumerate(((r["spec"], base), (twin["spec"], res))):
      im = ax[0, i].imshow(grid, aspect="auto", vmin=0, vmax=vmax, cmap="magma")
      ax[0, i].set(xlabel="head", ylabel="layer", title=f"{name} @ {budget:g}")
      fig.colorbar(im, ax=ax[0, i])
    fig.suptitle("Fig. 6a: score error sum|a - a*| per layer x head")
    render.save_figure(fig, workdir, f"fig6a_score_error_{r['spec']}_{budget:g}.png")


def _fig6a_reduction(red, workdir):
  fig, ax = render.new_figure(size=(6.0, 3.6))
  labels = [f"{r['selector']}@{r['budget']:g}" for r in red]
  x = np.arange(len(red))
  for i, m in enumerate(METRICS):
    ax[0, 0].bar(x + (i - 1) * 0.27, [100 * r[f"{m}_reduction"] for r in red], 0.27, label=m)
  ax[0, 0].set(xticks=x, ylabel="error reduction by RESA (%)",
               title="Fig. 6a: RESA's attention error reduction")
  ax[0, 0].set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
  ax[0, 0].legend(fontsize=7)
  render.save_figure(fig, workdir, "fig6a_error_reduction.png")
