"""Tables and figures of accuracy records (``experiments.tasks.accuracy``).

* one table per (model, protocol, context length): rows are methods (dense first), columns
  tasks and their average, each cell ``accuracy% [95% Wilson interval] n``;
* paired comparisons (``config.pairs``, e.g. ``("resa-quest", "quest")``: "+RESA vs its
  selector", or Expected Attention vs each baseline): the two methods at the same budget on
  the same samples, the mean difference with a paired-bootstrap 95% interval and, for 0/1
  scores, McNemar's exact p-value (``experiments.common.stats``);
* accuracy vs context length per method, and the needle depth x length heatmaps (Expected
  Attention Fig. 3) of configs with ``heatmap=True``.
"""

from __future__ import annotations

import collections
import os

import numpy as np

from experiments.common import method_style, render, stats
from experiments.tasks import ruler, scoring

PROTOCOL_TITLES = {"query_aware": "question in view while prefilling",
                   "query_agnostic": "context compressed before the question is read"}


def _order(labels):
  """Dense first, then first-appearance order."""
  seen = list(dict.fromkeys(labels))
  return sorted(seen, key=lambda x: (x != "dense", seen.index(x)))


def _protocol(r) -> str:
  return r.get("protocol", "query_aware")


def cell(scores) -> dict:
  n = len(scores)
  mean = float(np.mean(scores)) if n else float("nan")
  lo, hi = scoring.wilson(mean * n, n)
  return dict(mean=mean, lo=lo, hi=hi, n=n)


def _fmt(c) -> str:
  return f"{100 * c['mean']:.1f} [{100 * c['lo']:.0f}-{100 * c['hi']:.0f}] n={c['n']}"


def read_per_head(acc: dict) -> float:
  """Tokens a step reads per head from a record's ``attended_tokens``: the mean over the
  layers where recorded (a method with dense layers), else a sparse layer's ``total``."""
  return acc.get("layer_mean", acc["total"])


def _attended(rs) -> str:
  """Mean tokens attended per head at the first generated token (``read_per_head``)."""
  tot = [read_per_head(r["attended_tokens"]) for r in rs if r.get("attended_tokens")]
  if tot:
    return f"{np.mean(tot):.0f}"
  kept = [r["kv_kept"] for r in rs if r.get("kv_kept") is not None]
  return f"{np.mean(kept):.0f} kept" if kept else ""


def attended_share(rs) -> float | None:
  """Mean share of the context a method reads per head: attended tokens at the first answer
  token over the prompt (selection), or kept tokens over the context (compression); None for
  dense rows (nothing recorded). Puts rows with their own budget rule (ReSA's sparsity,
  RetroAttention's ``b``) beside the fixed-budget rows."""
  shares = [read_per_head(r["attended_tokens"]) / r["num_tokens"] if r.get("attended_tokens")
            else r["kv_kept"] / r["context_tokens"]
            for r in rs if r.get("attended_tokens") or r.get("kv_kept") is not None]
  return float(np.mean(shares)) if shares else None


def balanced_keys(keys) -> set:
  """The sample ids ``(task, length, seed, depth)`` with every task cut to the smallest task's
  count (lowest seeds first): a run that extended some tasks (the RESA headline's 45 samples
  per task, a task at a time) must not weight a mean over tasks toward them, so the mean stays
  the mean of the task means, as the papers average their tables."""
  by = collections.defaultdict(list)
  for k in keys:
    by[k[0]].append(k)
  n = min(map(len, by.values()), default=0)
  return {k for ks in by.values() for k in sorted(ks, key=lambda k: (k[2], str(k[3])))[:n]}


def balanced(rs) -> list[dict]:
  """``rs`` (one method) with every task cut to the same count (``balanced_keys``), in order."""
  keep = balanced_keys(_sample_id(r) for r in rs)
  return [r for r in rs if _sample_id(r) in keep]


def tables(records) -> list[str]:
  """Markdown sections: one table per (model, protocol, context length)."""
  by = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in records:
    by[(r["model"], _protocol(r), r["length"])][(r["method"], r["task"])].append(r)
  out = []
  for (model, protocol, length), cells in sorted(by.items()):
    tasks = [t for t in ruler.TASKS if any(k[1] == t for k in cells)]
    rows = []
    for label in _order([k[0] for k in cells]):
      row = {"method": label}
      for t in tasks:
        if (label, t) in cells:
          row[t] = _fmt(cell([r["score"] for r in cells[(label, t)]]))
      mine = [r for t in tasks for r in cells.get((label, t), [])]
      row["avg"] = _fmt(cell([r["score"] for r in balanced(mine)]))
      row["attended"] = _attended(mine)
      rows.append(row)
    title = (f"### Accuracy (%), model `{model}`, context {length} tokens, "
             f"{PROTOCOL_TITLES.get(protocol, protocol)}\n\n"
             "Cells: mean string-match score [95% Wilson interval] and the number of samples "
             "(avg: every task cut to the row's smallest task count); "
             "attended: tokens per head at the first answer token (forced + chosen), or the "
             "tokens per kv head a compression method kept.")
    out.append(title + "\n\n" + render.markdown_table(rows, ["method"] + tasks
                                                        + ["avg", "attended"]))
  return out


# ---------------------------------------------------------------- paired comparisons


def _sample_id(r):
  return (r["task"], r["length"], r["seed"], r["depth"])


def _pairs(records) -> list[tuple[str, str]]:
  seen = {}
  for r in records:
    for a, b in (r.get("config") or {}).get("pairs", ()) or ():
      seen[(a, b)] = None
  return list(seen)


def paired_rows(records) -> list[dict]:
  """One row per (model, protocol, length, pair, budget) with both methods on >= 1 sample (the
  common samples, every task cut to the same count: ``balanced_keys``)."""
  index = collections.defaultdict(dict)
  for r in records:
    index[(r["model"], _protocol(r), r["length"], r["spec"], r["budget"])][_sample_id(r)] = r
  rows = []
  for a, b in _pairs(records):
    for (model, protocol, length, spec, budget), mine in sorted(
        index.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
      if spec != a:
        continue
      other = index.get((model, protocol, length, b, budget))
      common = sorted(balanced_keys(set(mine) & set(other or {})), key=str)
      if not common:
        continue
      xa = np.array([mine[k]["score"] for k in common], float)
      xb = np.array([other[k]["score"] for k in common], float)
      row = dict(model=model, protocol=protocol, length=length, a=a, b=b,
                 budget=budget if budget is not None else "", n=len(common),
                 acc_a=100 * xa.mean(), acc_b=100 * xb.mean())
      row.update(_difference(xa, xb))
      rows.append(row)
  return rows


def _difference(xa, xb) -> dict:
  """Mean difference ``a - b`` (points) with its paired-bootstrap 95% interval, and McNemar's
  exact p-value when every score is 0 or 1."""
  diff, lo, hi = stats.paired_bootstrap(xa, xb)
  out = dict(diff=100 * diff, lo=100 * lo, hi=100 * hi)
  binary = np.isin(xa, (0.0, 1.0)).all() and np.isin(xb, (0.0, 1.0)).all()
  out["mcnemar_p"] = stats.mcnemar(xa, xb) if binary else ""
  return out


def paired_section(records) -> str | None:
  rows = paired_rows(records)
  if not rows:
    return None
  for r in rows:
    r["a - b [95% CI]"] = f"{r['diff']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}]"
  return ("### Paired comparisons (same samples)\n\n"
          "a - b: mean accuracy difference in points over the samples both methods ran, with a "
          "paired-bootstrap 95% interval; mcnemar_p: exact McNemar test (0/1 scores only).\n\n"
          + render.markdown_table(rows, ["model", "protocol", "length", "a", "b", "budget", "n",
                                         "acc_a", "acc_b", "a - b [95% CI]", "mcnemar_p"]))


# ---------------------------------------------------------------- figures


LEGEND_INSIDE, LEGEND_ROWS = 12, 28  # a legend of more rows goes beside the axes, in columns
LEGEND_WIDTH = 1.7  # inches a panel widens per legend column beside it


def _legend_columns(n: int) -> int:
  """Legend columns beside a panel of ``n`` lines (0: the legend fits inside)."""
  return 0 if n <= LEGEND_INSIDE else -(-n // LEGEND_ROWS)


def figure(records, workdir: str, name: str = "accuracy_vs_length.png"):
  """Average accuracy vs context length per method (one panel per model and protocol; every
  task cut to the same count, ``balanced``)."""
  by = collections.defaultdict(lambda: collections.defaultdict(list))
  for r in records:
    by[(r["model"], _protocol(r))][(r["method"], r["length"])].append(r)
  by = {k: {c: [r["score"] for r in balanced(rs)] for c, rs in cells.items()}
        for k, cells in by.items()}
  if not by:
    return None
  beside = max(_legend_columns(len({k[0] for k in cells})) for cells in by.values())
  fig, axes = render.new_figure(ncols=len(by), size=(5.0 + LEGEND_WIDTH * beside, 3.6))
  style = method_style.assign([{k[0] for k in cells} for cells in by.values()])
  for ax, ((model, protocol), cells) in zip(axes[0], sorted(by.items())):
    labels = _order([k[0] for k in cells])
    for label in labels:
      pts = sorted((ln, np.mean(v)) for (lab, ln), v in cells.items() if lab == label)
      ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=style[label].marker,
              color=style[label].colour, label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context (tokens)", ylabel="accuracy (%)")
    ax.set_title(f"{model} ({protocol})", fontsize=9)
    if len(labels) > LEGEND_INSIDE:  # beside the axes, in columns (a board's 50 rows)
      ax.legend(fontsize=5, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0,
                ncol=_legend_columns(len(labels)))
    else:
      ax.legend(fontsize=5)
  return render.save_figure(fig, workdir, name)


def heatmaps(records, workdir: str, name: str = "niah_heatmap.png"):
  """Needle depth x context length accuracy per method (Expected Attention Fig. 3), for the
  records of configs with ``heatmap=True``."""
  recs = [r for r in records if (r.get("config") or {}).get("heatmap")
          and r["depth"] is not None]
  labels = _order([r["method"] for r in recs])
  if not labels:
    return None
  depths = sorted({round(r["depth"], 3) for r in recs})
  lengths = sorted({r["length"] for r in recs})
  fig, axes = render.new_figure(ncols=len(labels), size=(2.6, 2.6))
  for ax, label in zip(axes[0], labels):
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
      for j, n in enumerate(lengths):
        sc = [r["score"] for r in recs if r["method"] == label and r["length"] == n
              and round(r["depth"], 3) == d]
        if sc:
          grid[i, j] = 100 * np.mean(sc)
    ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=6, rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=6)
    ax.set_title(f"{label}\n{np.nanmean(grid):.1f}%", fontsize=7)
    ax.set(xlabel="context", ylabel="needle depth")
  return render.save_figure(fig, workdir, name)


def figures(records, workdir: str) -> list[str]:
  return [p for p in (figure(records, workdir), heatmaps(records, workdir)) if p]


def write_outputs(records, workdir: str) -> str:
  sections = tables(records)
  pairs = paired_section(records)
  if pairs:
    sections.append(pairs)
  sections += [f"![{os.path.basename(p)}]({os.path.basename(p)})"
               for p in figures(records, workdir)]
  return render.write_markdown(workdir, "accuracy.md", "RULER-style accuracy", sections)
