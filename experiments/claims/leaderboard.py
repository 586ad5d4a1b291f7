"""The report's leaderboard (kvpress style): accuracy of every method row against the share of
the context it reads, per benchmark, protocol and context length.

``rows`` computes the cells from the ``accuracy`` experiment's records (once: the bootstrap
intervals are not free), ``markdown`` renders them as the report's tables (one per benchmark
and protocol, a row per method x budget, its lengths side by side), ``missing`` names the
rows a length lacks that another length of the same benchmark has, and ``figure`` draws, per
(benchmark, protocol, length), one panel per method family (``panels``: compression, split by
what the scores read when crowded; sparse decode with its presets; names the catalog does not
hold): accuracy (with its 95% interval)
against the share of the context read per head, a line per method through its budgets, dense
the dashed line of every panel.
"""

from __future__ import annotations

import collections
import functools
import re

import matplotlib.pyplot as plt
import numpy as np

from experiments.claims.tasks import base_label, benchmark, sample_key
from experiments.claims.verdicts import RULER_GENERATOR
from experiments.common import method_style, render, stats
from experiments.tasks import accuracy_report
from sparse_attn import compression, methods

XTICKS = (1, 2, 5, 10, 20, 50, 100)
DODGE = 1.06  # sideways spread (a factor on the log axis) between the points of one panel
ALIGNED = "RULER (NVIDIA generator)"  # records of experiments.tasks.ruler.GENERATOR
ORDER = {ALIGNED: 0, "RULER": 1, "needle grid": 2, "long-gen QA": 3}
PROTOCOLS = {"query_aware": 0, "query_agnostic": 1}  # the papers' main protocol first


def rows(records) -> list[dict]:
  """One row per (benchmark, protocol, method, budget, length) (the needle grid's lengths
  pooled, ``"1024-4096"``): ``share`` of the context read per head (``accuracy_report.attended_share``; None for dense), mean accuracy (%) with a 95%
  interval (Wilson for 0/1 scores, bootstrap otherwise), tasks averaged and samples (each task
  cut to the cell's smallest count, ``accuracy_report.balanced``); dense first in each (benchmark, protocol,
  length) group, then by accuracy. A sample two workdirs both ran (same task, length, seed and
  depth: e.g. a grid and a headline rerun) counts once."""
  cells = collections.defaultdict(dict)
  for r in records:
    cells[(_benchmark(r), r.get("protocol", ""), r["method"], r.get("budget"),
           r.get("length"))][sample_key(r)] = r
  cells = {k: accuracy_report.balanced(list(v.values())) for k, v in cells.items()}
  cells = _pool_lengths(cells, "needle grid")
  out = []
  for (bench, proto, method, budget, length), rs in cells.items():
    x = np.asarray([float(r["score"]) for r in rs])
    if np.all(np.isin(x, (0.0, 1.0))):
      lo, hi = stats.wilson(int(x.sum()), len(x))
    else:
      _, lo, hi = stats.paired_bootstrap(x, np.zeros_like(x))
    share = accuracy_report.attended_share(rs)
    out.append(dict(benchmark=bench, protocol=proto, method=method,
                    budget="-" if budget is None else budget, length=length, share=share,
                    attended="-" if share is None else f"{100 * share:.1f}%",
                    accuracy=round(100 * x.mean(), 1), lo=100 * lo, hi=100 * hi,
                    interval=f"[{100 * lo:.1f}, {100 * hi:.1f}]",
                    tasks=len({r.get("task") for r in rs}), n=len(x)))
  out.sort(key=lambda r: (ORDER[r["benchmark"]], r["protocol"], r["length"],
                          r["method"] != "dense", -r["accuracy"]))
  return out


def _benchmark(r) -> str:
  """``benchmark(r)``, with RULER records of NVIDIA/RULER's generator apart from those of the
  earlier variant (different prompts and needle positions: never one cell)."""
  b = benchmark(r)
  return ALIGNED if b == "RULER" and r.get("generator") == RULER_GENERATOR else b


def _pool_lengths(cells, bench: str) -> dict:
  """``cells`` with ``bench``'s lengths pooled into one cell per row, keyed ``"lo-hi"``: the
  needle grid is one benchmark over its lengths (EA Fig. 3 averages its depth x length grid;
  a length alone holds a few depths)."""
  pooled, lengths = collections.defaultdict(list), set()
  for key, rs in cells.items():
    if key[0] == bench:
      pooled[key[:4]] += rs
      lengths.add(key[4])
  if len(lengths) < 2:
    return cells
  span = f"{min(lengths)}-{max(lengths)}"
  out = {key: rs for key, rs in cells.items() if key[0] != bench}
  out.update({key + (span,): rs for key, rs in pooled.items()})
  return out


def markdown(board: list[dict]) -> str:
  """``rows``' answer as one table per (benchmark, protocol), its lengths side by side (the
  issue's "every method x budget at 4k and 8k"): per length the accuracy, its interval and
  samples, and the share of the context the row reads there; dense first, then by accuracy at
  the longest length (rows it lacks after, by the next length). "" without rows."""
  groups = collections.defaultdict(list)
  for r in board:
    groups[(r["benchmark"], r["protocol"])].append(r)
  full = _dense_tasks(board)
  tables = []
  for (bench, proto), rs in sorted(groups.items(), key=lambda kv: (
      ORDER[kv[0][0]], PROTOCOLS.get(kv[0][1], len(PROTOCOLS)), kv[0][1])):
    lengths = sorted({r["length"] for r in rs}, key=_length_order)
    cells = collections.defaultdict(dict)
    for r in rs:
      cells[(r["method"], r["budget"])][r["length"]] = r
    longest_first = lengths[::-1]

    def order(item, longest_first=longest_first):
      (method, _), by = item
      accs = [-by[n]["accuracy"] if n in by else np.inf for n in longest_first]
      return (method != "dense", *accs)

    table = []
    for (method, budget), by in sorted(cells.items(), key=order):
      row = dict(method=method, budget=budget,
                 tasks="/".join(sorted({str(c["tasks"]) for c in by.values()})))
      for n in lengths:
        c = by.get(n)
        row[f"{n}"] = (f"{c['accuracy']:.1f} {c['interval']} ({c['n']}{_fewer(c, full)})"
                       if c else "not run")
        row[f"read at {n}"] = c["attended"] if c else ""
      table.append(row)
    columns = (["method", "budget"] + [f"{n}" for n in lengths]
               + [f"read at {n}" for n in lengths] + ["tasks"])
    tables.append(f"**{bench}, {proto}** (accuracy % [95% interval] (samples) per context "
                  "length in tokens)\n\n" + render.markdown_table(table, columns))
  return "\n\n".join(tables)


def _dense_tasks(board: list[dict]) -> dict:
  """``(benchmark, protocol, length) -> tasks`` of dense's cells."""
  return {(r["benchmark"], r["protocol"], r["length"]): r.get("tasks") for r in board
          if r["method"] == "dense"}


def _fewer(cell: dict, dense_tasks: dict) -> str:
  """``", k of N tasks"`` where a cell averages fewer tasks than dense at its length (its mean
  is not comparable to the full rows'), else ""."""
  n = dense_tasks.get((cell["benchmark"], cell["protocol"], cell["length"]))
  if n is None or cell.get("tasks") is None or cell["tasks"] >= n:
    return ""
  return f", {cell['tasks']} of {n} tasks"


def _length_order(length) -> int:
  """Lengths in order; a pooled span ``"lo-hi"`` by its upper end."""
  return int(str(length).split("-")[-1])


def missing(board: list[dict]) -> str:
  """Lines naming the rows that averaged fewer tasks than dense at a length; per (benchmark,
  protocol), the rows that ran at some of its lengths but not at the others; and the lengths its
  benchmark ran under another protocol but this protocol not at all ("" when every length has
  every row on every task): the leaderboard's gaps, said in the open."""
  ran = collections.defaultdict(lambda: collections.defaultdict(set))
  for r in board:
    ran[(r["benchmark"], r["protocol"])][r["length"]].add(r["method"])
  lengths = collections.defaultdict(set)  # benchmark -> every length any protocol ran
  for (bench, _), by_length in ran.items():
    lengths[bench].update(by_length)
  fewer = collections.defaultdict(list)  # (benchmark, protocol, length) -> partial rows
  dense = _dense_tasks(board)
  for r in board:
    got = _fewer(r, dense)
    if got:
      fewer[(r["benchmark"], r["protocol"], r["length"])].append(f"{r['method']} ({got[2:]})")
  lines = []
  for (bench, proto, length), rows_ in fewer.items():
    lines.append(f"- fewer tasks than dense at {length} tokens ({bench}, {proto}): "
                 + ", ".join(rows_))
  for (bench, proto), by_length in sorted(ran.items(), key=lambda kv: (ORDER[kv[0][0]], kv[0][1])):
    every = set().union(*by_length.values())
    for length in sorted(lengths[bench], key=_length_order):
      gap = sorted(every - by_length.get(length, set()))
      if length not in by_length:
        lines.append(f"- not run at {length} tokens ({bench}, {proto}): no row "
                     f"({len(gap)} rows ran at other lengths)")
      elif gap:
        lines.append(f"- not run at {length} tokens ({bench}, {proto}): {', '.join(gap)}")
  return "\n".join(lines)


# the figure's panels per (benchmark, protocol, length): one per family, in this order
FAMILY_TITLES = {"compression": "compression (eviction)",
                 # a crowded compression panel split by what the scores read (_split_crowded)
                 "compression:attention": "compression, scored by attention weights",
                 "compression:queries": "compression, scored by query statistics",
                 "compression:keys": "compression, scored by keys, values or position",
                 "sparse-decode": "sparse decode (a subset read per step)",
                 "other": "other (not in the catalog)", "dense": "dense"}
PARTIAL_TITLE = "\n(rows on fewer tasks than dense)"
CROWDED = 12  # a panel with more lines than this has its legend outside the axes
LEGEND_ROWS = 28  # entries per column of such a legend (fontsize 4.5 in a PANEL's height)
PANEL, SLOT = (4.6, 3.8), 1.5  # inches: a panel (width, height); a legend column beside one
SPREAD = 1.35  # at most this factor either side of a share between one panel's dodged points
# the dodged points of a row at 1% or 100% (ThinK reads every token: it prunes key channels) in
# view
XLIM = (1.0 / SPREAD, 100.0 * SPREAD)
LABEL = 40  # legend labels past this many characters are cut (a calibration file's path)


@functools.cache
def _catalog_families() -> dict[str, str]:
  """catalog name -> its family; a preset -> the family of the method it presets (the
  ``expected-attention`` preset is compression, ``resa-quest`` sparse decode). A compression
  method whose decode reads a subset of the kept cache per step (``SPARSE_DECODE``: RocketKV)
  is drawn with the sparse decoders, at the share it reads."""
  info = {i.name: i for i in methods.available()}
  sparse = {name for name, build in compression.BUILDERS.items()
            if getattr(getattr(build, "method_class", build), "SPARSE_DECODE", False)}
  out = {}
  for name, i in info.items():
    if i.family == "preset":
      name_of_base = _spec_name(i.spec)
      base = info.get(name_of_base)
      out[name] = base.family if base is not None and base.family != "preset" else "other"
    else:
      name_of_base = name
      out[name] = i.family
    if name_of_base in sparse:
      out[name] = "sparse-decode"
  return out


def _spec_name(spec: str) -> str:
  """The first method name of a spec: ``"resa-quest+calibrated:fit=a"`` -> ``"resa-quest"``."""
  return re.split(r"[:+]", str(spec), maxsplit=1)[0]


@functools.cache
def _catalog_signals() -> dict[str, str | None]:
  """catalog name -> what its scores are computed from (``MethodInfo.signal``)."""
  return {i.name: i.signal for i in methods.available()}


def family(label) -> str:
  """The figure's family of a row label (``base_label``, then its spec's first name, looked up
  in ``sparse_attn.methods.available()``): ``"dense"``, ``"compression"``, ``"sparse-decode"``
  or ``"other"`` (a name the catalog does not hold)."""
  return _catalog_families().get(_spec_name(base_label(label)), "other")


def panels(board: list[dict]) -> dict[tuple, list[dict]]:
  """``(benchmark, protocol, length, family, partial) -> rows`` of ``figure``'s panels, in
  drawing order: each (benchmark, protocol, length) split by family (``FAMILY_TITLES``' order;
  families without rows there have no panel), dense's rows in every panel of their group (a
  group of dense alone: one ``"dense"`` panel). A method with a budget averaging fewer tasks
  than dense there (a run still going, a diagnostic on a few tasks) is drawn in a panel of its
  own after its family's (``partial`` True), so that the rows compared are the comparable ones.
  A compression panel of more than ``CROWDED`` methods is split by what their scores read
  (family ``"compression:attention"``, ``":queries"``, ``":keys"``: ``_split_crowded``)."""
  dense_tasks = _dense_tasks(board)
  groups = collections.defaultdict(list)
  for r in board:
    groups[(r["benchmark"], r["protocol"], r["length"])].append(r)
  out = {}
  for key in sorted(groups, key=lambda k: (ORDER[k[0]], PROTOCOLS.get(k[1], len(PROTOCOLS)),
                                           k[1], _length_order(k[2]))):
    partial = {base_label(r["method"]) for r in groups[key] if _fewer(r, dense_tasks)}
    by = collections.defaultdict(list)
    for r in groups[key]:
      fam = family(r["method"])
      by[fam, fam != "dense" and base_label(r["method"]) in partial].append(r)
    dense = by.pop(("dense", False), [])
    by = _split_crowded(by)
    order = lambda fp: (list(FAMILY_TITLES).index(fp[0].split(":")[0]), fp[1],
                        list(FAMILY_TITLES).index(fp[0]))
    for fam, part in sorted(by, key=order) or [("dense", False)]:
      out[key + (fam, part)] = dense + by.get((fam, part), [])
  return out


def _split_crowded(by: dict) -> dict:
  """``by`` (``(family, partial) -> rows``) with each compression entry of more than
  ``CROWDED`` methods split by what their scores read (``compression:<signal>``, the catalog's
  ``signal``), so that a panel of the whole board stays readable."""
  out = collections.defaultdict(list)
  for (fam, part), rs in by.items():
    if fam != "compression" or len({base_label(r["method"]) for r in rs}) <= CROWDED:
      out[fam, part] += rs
      continue
    for r in rs:
      sub = f"compression:{_catalog_signals().get(_spec_name(base_label(r['method'])))}"
      out[sub if sub in FAMILY_TITLES else fam, part].append(r)
  return out


def figure(board: list[dict], workdir: str, name: str = "leaderboard.png") -> str | None:
  """Writes the figure of ``rows``' answer into ``workdir``; returns its path (None without
  rows). One panel per ``panels`` key (three to a row; a family's rows on fewer tasks than
  dense in a panel after its own): accuracy (95% interval) against the
  share of the context read per head, a line per method through its budgets, dense the dashed
  line of every panel; one colour and marker per method across the figure. A method with a
  budget averaging fewer tasks than dense there (a run still going, a diagnostic on a few
  tasks: its mean is not comparable) is drawn dotted with hollow markers, its label saying
  ``"(k of N tasks)"``."""
  grid = panels(board)
  if not grid:
    return None
  dense_tasks = _dense_tasks(board)
  lines = {k: {base_label(r["method"]) for r in rs if family(r["method"]) != "dense"}
           for k, rs in grid.items()}
  fig, axes, beside = _layout(grid, lines)
  # one colour and marker per method in every panel, distinct within a panel
  style = method_style.assign(lines.values())
  for a, ((bench, proto, length, fam, part), rs) in zip(axes, grid.items()):
    by = collections.defaultdict(list)
    for r in rs:
      if family(r["method"]) == "dense":
        a.axhline(r["accuracy"], color="k", ls="--", lw=1, label=r["method"])
      else:
        by[base_label(r["method"])].append(r)
    # methods at one share (e.g. every eviction at 50%) are spread sideways to stay readable
    step = min(DODGE, SPREAD ** (2 / max(1, len(by) - 1)))
    for i, (m, line) in enumerate(sorted(by.items())):
      st = style[m]
      at = [r for r in line if r["share"] is not None]
      for r in line:  # a row without a share (none recorded): a level line
        if r["share"] is None:
          a.axhline(r["accuracy"], color=st.colour, ls=":", lw=1, label=_short(r["method"]))
      if not at:
        continue
      # one line per method across its budgets (kvpress style)
      at.sort(key=lambda r: r["share"])
      x = [100 * r["share"] * step ** (i - (len(by) - 1) / 2) for r in at]
      err = [[r["accuracy"] - r["lo"] for r in at], [r["hi"] - r["accuracy"] for r in at]]
      fewer = min((r for r in at if _fewer(r, dense_tasks)), key=lambda r: r["tasks"],
                  default=None)
      label = _short(m) + (f" ({_fewer(fewer, dense_tasks)[2:]})" if fewer else "")
      a.errorbar(x, [r["accuracy"] for r in at], yerr=err, fmt=st.marker + (":" if fewer else "-"),
                 color=st.colour, ms=4, lw=1, capsize=2, label=label,
                 mfc="none" if fewer else st.colour)
    a.set(xscale="log", xlabel="context read per head (%)", ylabel="accuracy (%)",
          title=f"{bench}, {proto}, {length} tokens\n{FAMILY_TITLES[fam]}"
          + (PARTIAL_TITLE if part else ""), ylim=(-3, 103),
          xlim=XLIM)
    a.set_xticks(XTICKS, [f"{t:g}" for t in XTICKS])
    a.minorticks_off()
    a.title.set_fontsize(8)
    if a in beside:  # in its own slot beside the axes, so that the points stay visible
      slot, ncol = beside[a]
      slot.legend(*a.get_legend_handles_labels(), fontsize=4.5, loc="upper left",
                  borderaxespad=0, ncol=ncol)
    else:
      a.legend(fontsize=5, loc="best")
  return render.save_figure(fig, workdir, name)


def _layout(grid: dict, lines: dict):
  """``(fig, axes, beside)`` for ``figure``: a panel per ``grid`` key, three to a row; a column
  holding a panel of more than ``CROWDED`` lines is followed by a legend slot (``beside``: such
  a panel's axes -> (its slot's axes, legend columns))."""
  keys = list(grid)
  ncols, nrows = min(3, len(keys)), -(-len(keys) // 3)
  legend_cols = {k: -(-(len(lines[k]) + 1) // LEGEND_ROWS) if len(lines[k]) > CROWDED else 0
                 for k in keys}
  slots = [max(legend_cols[k] for k in keys[c::ncols]) for c in range(ncols)]
  first = [sum(1 + bool(n) for n in slots[:c]) for c in range(ncols)]  # gridspec columns
  widths = [w for n in slots for w in ((PANEL[0], SLOT * n) if n else (PANEL[0],))]
  fig = plt.figure(figsize=(sum(widths), PANEL[1] * nrows))
  gs = fig.add_gridspec(nrows, len(widths), width_ratios=widths)
  axes, beside = [], {}
  for i, k in enumerate(keys):
    row, col = divmod(i, ncols)
    axes.append(fig.add_subplot(gs[row, first[col]]))
    if legend_cols[k]:
      slot = fig.add_subplot(gs[row, first[col] + 1])
      slot.axis("off")
      beside[axes[-1]] = (slot, legend_cols[k])
  return fig, axes, beside


def _short(label: str) -> str:
  """``label`` cut to ``LABEL`` characters (its end kept: options differ there)."""
  if len(label) <= LABEL:
    return label
  return label[:LABEL // 2 - 1] + "..." + label[-(LABEL // 2 - 2):]
