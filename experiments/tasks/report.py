"""One markdown report of every JSONL result under a directory (all experiments, all models).

Records are grouped by their ``experiment`` field; each experiment module renders its own
tables and figures (``tables(records)``, ``figure(s)(records, workdir)``). Experiments this
module does not know are listed with their record counts, so nothing is silently dropped.
"""

from __future__ import annotations

import collections
import os

from experiments.common import render, results
from experiments.tasks import accuracy_report, long_generation, perplexity

RENDERERS = {
    "accuracy": (lambda r: accuracy_report.tables(r) + list(
        filter(None, [accuracy_report.paired_section(r)])), accuracy_report.figures),
    "perplexity": (perplexity.tables, perplexity.figures),
    "long_generation": (long_generation.tables, long_generation.figures),
}
TITLES = {"accuracy": "RULER-style accuracy", "perplexity": "Perplexity under sparse decoding",
          "long_generation": "Long-generation fidelity"}


def collect(root: str) -> dict[str, list[dict]]:
  """experiment -> records of every ``results.jsonl`` under ``root`` (``source`` added)."""
  out = collections.defaultdict(list)
  for path in sorted(results.find_results(root)):
    for r in results.read_records(path):
      out[r.get("experiment", "unknown")].append(dict(r, source=os.path.relpath(path, root)))
  return out


def build(root: str, out_dir: str | None = None, name: str = "report.md") -> str:
  """Writes ``out_dir/name`` (default: ``root/report.md``) and its figures; returns the path."""
  out_dir = out_dir or root
  os.makedirs(out_dir, exist_ok=True)
  groups = collect(root)
  sections = []
  sources = sorted({r["source"] for recs in groups.values() for r in recs})
  models = sorted({r.get("model", "?") for recs in groups.values() for r in recs})
  revs = sorted({r.get("git", "?") for recs in groups.values() for r in recs})
  sections.append(f"Results from {len(sources)} file(s) under `{root}`: "
                  + ", ".join(f"`{s}`" for s in sources) + f".\n\nModels: {', '.join(models)}."
                  f" Git revisions: {', '.join(revs)}.")
  for exp in ("accuracy", "perplexity", "long_generation"):
    recs = groups.pop(exp, [])
    if not recs:
      continue
    tables, figs = RENDERERS[exp]
    sub = os.path.join(out_dir, "figures", exp)
    os.makedirs(sub, exist_ok=True)
    paths = [p for p in figs(recs, sub) if p]
    body = "\n\n".join(tables(recs))
    body += "".join(f"\n\n![{os.path.basename(p)}]({os.path.relpath(p, out_dir)})"
                    for p in paths)
    sections.append(f"## {TITLES[exp]}\n\n{body}")
  if groups:
    sections.append("## Other results\n\n" + "\n".join(
        f"- `{exp}`: {len(recs)} records (no renderer here)" for exp, recs in groups.items()))
  return render.write_markdown(out_dir, name, "Sparse attention: task experiments report",
                               sections)
