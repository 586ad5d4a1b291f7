r"""The reproduction report: each paper claim next to what this library measures.

  python -m experiments.claims --workdir=results     # writes results/REPORT.md

Reads every ``WORKDIR/*/results.jsonl`` (the committed records), measures each claim registered
in ``experiments.registry`` on them, and writes ``WORKDIR/REPORT.md``: the claims table
(paper's number, ours with an interval and the sample count, setting, verdict and why, the figure
that shows it), the leaderboard (``experiments.claims.leaderboard``), the measured wall time
of every part (``WORKDIR/timings.jsonl``), and the per-experiment report
(``experiments.report``). A claim whose experiment has no records yet is listed as "not run",
never dropped.
"""

from __future__ import annotations

import datetime
import json
import os

from experiments import registry
from experiments.claims import leaderboard
from experiments.claims import verdicts
from experiments.common import render, results
from experiments.tasks import ruler

COLUMNS = ("claim", "source", "paper", "ours", "n", "setting", "verdict", "why", "figure")


def read_files(root: str) -> dict[str, list[dict]]:
  """``results.jsonl`` path -> its records, for every one under ``root`` (read once)."""
  return {path: results.read_records(path) for path in sorted(results.find_results(root))}


def load(root: str, files: dict[str, list[dict]] | None = None) -> dict[str, list[dict]]:
  """experiment name -> its records, from every ``results.jsonl`` under ``root`` (or from
  ``files``, ``read_files``'s answer)."""
  out: dict[str, list[dict]] = {}
  for recs in (read_files(root) if files is None else files).values():
    for r in recs:
      out.setdefault(r.get("experiment", "unknown"), []).append(r)
  return out


def gpu_folders(files: dict[str, list[dict]], root: str) -> dict[str, list[str]]:
  """GPU name -> the folders under ``root`` holding records measured on it (in path order)."""
  out: dict[str, list[str]] = {}
  for path, recs in sorted(files.items()):
    folder = os.path.relpath(os.path.dirname(path), root)
    for dev in dict.fromkeys(r["device"] for r in recs if r.get("device")
                             and r.get("machine", {}).get("backend") == "gpu"):
      if folder not in out.setdefault(dev, []):
        out[dev].append(folder)
  return out


def folders_of(files: dict[str, list[dict]], root: str) -> dict[int, str]:
  """``id(record)`` -> the folder under ``root`` whose ``results.jsonl`` holds it."""
  return {id(r): os.path.relpath(os.path.dirname(path), root)
          for path, recs in files.items() for r in recs}


def figure_folder(read: list[dict] | None, folders: dict[int, str], root: str, figure: str,
                  default: str) -> str:
  """The folder whose figure a claim row links: of the folders holding ``figure``, the one
  holding most of the records the row ``read`` (a row on RULER's aligned generator links the
  aligned run's plot, not the earlier variant's); ``default`` (the part's folder) otherwise."""
  counts: dict[str, int] = {}
  for r in read or ():
    where = folders.get(id(r))
    if where is not None and os.path.exists(os.path.join(root, where, figure)):
      counts[where] = counts.get(where, 0) + 1
  return max(sorted(counts), key=counts.get) if counts else default


def claim_rows(records: dict[str, list[dict]], root: str,
               experiments=registry.EXPERIMENTS,
               folders: dict[int, str] | None = None) -> list[dict]:
  """One row per registered claim: the paper's number, ours measured on ``records``
  (experiment -> records; each measure returns a ``row.Measured``), the verdict; a claim
  without records is "not run". A measure may say which records it read (``Measured.read``):
  with ``folders`` (``folders_of``) the row's figure is then taken from the folder holding
  most of them (``figure_folder``)."""
  rows = []
  for c, part, e in registry.claims(experiments):
    recs = records.get(e.name, [])
    measure = registry.load(c.measure)
    got = measure(recs) if recs else None
    row = dict(claim=c.claim, source=c.source, paper=c.paper)
    if got is None:
      why = (f"the `{e.name}` records hold no rows for this claim yet" if recs
             else f"no `{e.name}` records under `{root}` yet")
      row.update(ours="-", n=0, setting="-", verdict="not run", why=why, figure="")
    else:
      # records that cannot be tied to code: the row says so
      notes = verdicts.provenance_notes(recs, measure, got)
      got = got.plus(setting="".join(f"; ⚠ {note}" for note in notes))
      where = figure_folder(got.read, folders or {}, root, c.figure, part.name) if c.figure else ""
      fig = os.path.normpath(os.path.join(where, c.figure)) if c.figure else ""
      shown = fig and os.path.exists(os.path.join(root, fig))
      row.update(got.columns(), figure=f"[{os.path.basename(fig)}]({fig})" if shown else "")
    rows.append(row)
  return rows


SESSION_GAP_S = 1800  # records further apart than this belong to separate runs


def _seconds(stamp: str) -> float:
  return datetime.datetime.fromisoformat(stamp).timestamp()


def record_minutes(records) -> tuple[float, int]:
  """``(minutes, runs)`` a workdir's records took: the spans of its runs (record times split at
  gaps over ``SESSION_GAP_S``), each with the first batch's ``batch_seconds`` where recorded
  (the work before a run's first record)."""
  recs = sorted((r for r in records if r.get("time")), key=lambda r: r["time"])
  total, runs, start, prev = 0.0, 0, None, None
  for r in recs:
    t = _seconds(r["time"])
    if prev is None or t - prev > SESSION_GAP_S:
      if start is not None:
        total += prev - start
      runs += 1
      start = t - float(r.get("batch_seconds") or 0.0)
    prev = t
  if start is not None:
    total += prev - start
  return total / 60, runs


def _reproduce_runs(root: str) -> dict[str, list[tuple[float, float]]]:
  """part -> ``(finished, minutes)`` of each run ``experiments.reproduce`` logged in
  ``timings.jsonl``."""
  path = os.path.join(root, "timings.jsonl")
  out = {}
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          finished = datetime.datetime.fromisoformat(r["finished"]).replace(
              tzinfo=datetime.timezone.utc).timestamp()
          out.setdefault(r["part"].split(":")[0], []).append(
              (finished, round(r["seconds"] / 60, 1)))
  return out


def timings(root: str, files: dict[str, list[dict]] | None = None) -> list[dict]:
  """One row per workdir: minutes from its record times (every part, however it was run) and
  from ``experiments.reproduce``'s log of the run that wrote its last record, if it ran it.
  ``files``: ``read_files(root)``'s answer, if already read."""
  logged = _reproduce_runs(root)
  rows = []
  for path, recs in (read_files(root) if files is None else files).items():
    part = os.path.relpath(os.path.dirname(path), root)
    recs = [r for r in recs if r.get("time")]
    if not recs:
      continue
    minutes, runs = record_minutes(recs)
    times = sorted(r["time"] for r in recs)
    last = _seconds(times[-1])
    log = [m for done, m in logged.get(part, ()) if 0 <= done - last <= SESSION_GAP_S]
    rows.append(dict(part=part, minutes=round(minutes, 1) if round(minutes, 1) > 0 else "-", runs=runs,
                     records=len(recs), first=times[0][:16], last=times[-1][:16],
                     reproduce_log=log[-1] if log else "-"))
  return rows


def needle_diagnosis(records) -> str:
  """Why EA misses needles (EA Fig. 3 row): which methods keep the needle where the question
  reads it, from ``experiments.needle_keep``'s records; "" without records."""
  if not records:
    return ""
  from experiments.analysis import needle_keep  # pylint: disable=g-import-not-at-top
  rows = needle_keep.table(records)
  cfg = records[0].get("config", {})
  dirty = sum(map(verdicts.is_dirty, records))
  mark = (f" ⚠ {dirty} of its {len(records)} records are from a modified tree (they cannot be "
          "tied to code)." if dirty else "")
  return ("## Diagnosis: which tokens compression keeps (needle grid)\n\n"
          f"`needle_keep` ({cfg.get('model')}, {cfg.get('tasks')}, {cfg.get('lengths')} tokens, "
          "50% kept): the share of the needle's tokens each method keeps per layer and kv head, "
          "weighted by the dense model's attention from the question on the needle there "
          "(`weighted_recall`, %), for needles in the first half (`shallow`) and the second "
          "half (`deep`) of the context. Figure: "
          f"[needle_keep.png](needle_keep/needle_keep.png).{mark}\n\n"
          + render.markdown_table(rows, ["method", "weighted_recall", "shallow", "deep",
                                         "needle_recall", "kept", "n"], digits=3))


def ruler_section(accuracy: list[dict]) -> str:
  """How the RULER records were generated: NVIDIA/RULER's rules, and what still differs."""
  aligned = sum(r.get("generator") == verdicts.RULER_GENERATOR for r in accuracy)
  return ("## RULER\n\nThe RULER tasks are generated as NVIDIA/RULER's own generator makes them "
          "(`experiments/tasks/ruler.py`): random needle positions, its prompts and answer "
          "prefixes, one-shot examples, word counts and generation caps. "
          f"{aligned} of {len(accuracy)} accuracy records come from that generator; the others "
          "from this library's earlier variant (fixed depths, its own prompts and word counts), "
          "which the claims use only where no aligned records exist and then say so. "
          "What still differs from RULER:\n\n"
          + "\n".join(f"- {d}" for d in ruler.DIFFERENCES))


HEAD_START = "<!-- claims head: written by python -m experiments.claims -->"
HEAD_END = "<!-- end of claims head -->"


def head_table(rows: list[dict]) -> str:
  """The README's head of the report: each claim, the paper's number, our verdict."""
  return render.markdown_table(
      [dict(claim=f"{r['source']}: {r['claim']}", paper=r["paper"], verdict=r["verdict"])
       for r in rows], ["claim", "paper", "verdict"])


def update_head(path: str, rows: list[dict]) -> bool:
  """Rewrites the block between ``HEAD_START`` and ``HEAD_END`` of ``path`` (the README) with
  ``head_table(rows)``; False when the file or its markers are missing."""
  if not os.path.isfile(path):
    return False
  text = open(path, encoding="utf-8").read()
  if HEAD_START not in text or HEAD_END not in text:
    return False
  before, rest = text.split(HEAD_START, 1)
  after = rest.split(HEAD_END, 1)[1]
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"{before}{HEAD_START}\n{head_table(rows)}\n{HEAD_END}{after}")
  return True


def build(root: str, readme: str | None = None, experiments=registry.EXPERIMENTS) -> str:
  """Writes ``root/REPORT.md`` (and the head table into ``readme``, if given); returns the
  report's path. ``experiments``: the registry whose claims it measures."""
  files = read_files(root)
  records = load(root, files)
  rows = claim_rows(records, root, experiments, folders_of(files, root))
  if readme:
    update_head(readme, rows)
  counts = {v: sum(r["verdict"] == v for r in rows) for v in verdicts.VERDICTS}
  sections = [
      "Every number below is computed from the committed `*/results.jsonl` by "
      "`python -m experiments.claims --workdir=results`; intervals are 95% bootstrap intervals "
      "(paired where two methods ran on the same samples) or Wilson intervals for accuracies. "
      "Each claim is registered in `experiments/registry.py` with the function that measures "
      "it and states its verdict rule (`experiments/claims/`).",
      "Verdicts: " + ", ".join(f"{v} {n}" for v, n in counts.items()) + ".",
      "## Claims\n\n" + render.markdown_table(rows, COLUMNS)]
  accuracy = records.get("accuracy", [])
  if accuracy:
    board = leaderboard.rows(accuracy)
    fig = leaderboard.figure(board, root)
    sections.append(
        "## Leaderboard (RULER-style accuracy)\n\nOne row per method x budget, the context "
        "lengths side by side. `read at N`: the share of the context the row reads per head at "
        "N tokens (selection: tokens attended at the first answer token, sinks and local window "
        "included, over the prompt; compression: tokens kept over the context).\n\n"
        + leaderboard.markdown(board)
        + (f"\n\n{gaps}" if (gaps := leaderboard.missing(board)) else "")
        + (f"\n\n![leaderboard]({os.path.basename(fig)})" if fig else ""))
  diag = needle_diagnosis(records.get("needle_keep", []))
  if diag:
    sections.append(diag)
  t = timings(root, files)
  if t:
    total = sum(r["minutes"] for r in t if r["minutes"] != "-")
    gpus = gpu_folders(files, root)  # already read above
    on_gpu = "; ".join(f"{', '.join(f'`{f}`' for f in where)}: one {dev}"
                       for dev, where in gpus.items())
    sections.append(
        f"## Wall time: {total:.0f} min in all\n\nOn this machine (2 CPU cores"
        + (f"; {on_gpu}" if on_gpu else "") + "). "
        "`minutes`: from the first to the last record of each run of the part (runs "
        "split at gaps over 30 min), plus the first batch's time where the records hold it (`-`: "
        "one record, no span); "
        "parts that ran in parallel processes count once. `reproduce_log`: the minutes "
        "`experiments.reproduce` logged for its last run of the part (process start to end, "
        "model loading included), where it ran it.\n\n"
        + render.markdown_table(t, ["part", "minutes", "runs", "records", "first", "last",
                                    "reproduce_log"]))
  sections.append(ruler_section(records.get("accuracy", [])))
  sections.append("Per-experiment tables and figures: each folder's markdown (e.g. "
                  "`svd_analysis/svd_analysis.md`) and `report.md` (`python -m experiments.report"
                  " --workdir=results`).")
  return render.write_markdown(root, "REPORT.md", "Reproduction report", sections)
