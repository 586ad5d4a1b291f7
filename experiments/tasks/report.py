"""One markdown report of every JSONL result under a directory (all experiments, all models).

Records are grouped by results file and ``experiment`` field, and each group is rendered by its
experiment's own renderer (the one its run uses: ``RENDERERS``) into
``figures/<experiment>/<workdir>/``; the renderer's markdown is embedded with its headings
demoted and its figure links rebased, and figures it does not link are appended. Experiments
without a renderer are listed with their record counts, so nothing is silently dropped.
"""

from __future__ import annotations

import collections
import importlib
import os
import re

from experiments.common import render, results

# experiment -> (module, function(records, out_dir), markdown file it writes into out_dir).
RENDERERS = {
    "accuracy": ("experiments.tasks.accuracy_report", "write_outputs", "accuracy.md"),
    "perplexity": ("experiments.tasks.perplexity", "write_outputs", "perplexity.md"),
    "long_generation": ("experiments.tasks.long_generation", "write_outputs",
                        "long_generation.md"),
    "attention_error": ("experiments.analysis.error_experiment", "render_all",
                        "attention_error.md"),
    "budget_reduction": ("experiments.analysis.budget_experiment", "render_all",
                         "budget_reduction.md"),
    "resa_lambda": ("experiments.analysis.lambda_experiment", "render_all", "resa_lambda.md"),
    "resa_calibrate": ("experiments.analysis.calibrate_experiment", "render_all",
                       "resa_calibrate.md"),
    "svd_analysis": ("experiments.analysis.svd_experiment", "render_all", "svd_analysis.md"),
    "latency": ("experiments.latency_lib.report", "write", "latency.md"),
    "needle_keep": ("experiments.analysis.needle_experiment", "render_all", "needle_keep.md"),
}


def collect(root: str) -> dict[tuple[str, str], list[dict]]:
  """``(results file relative to root, experiment) -> records`` of every results.jsonl."""
  out = collections.defaultdict(list)
  for path in sorted(results.find_results(root)):
    source = os.path.relpath(path, root)
    for r in results.read_records(path):
      out[(source, r.get("experiment", "unknown"))].append(dict(r, source=source))
  return out


def _embed(markdown: str, section_dir: str, out_dir: str) -> tuple[str, str]:
  """``(title, body)``: the renderer's ``# title``, its body with headings one level down and
  relative figure links rebased from ``section_dir`` to ``out_dir``."""
  lines = markdown.strip().splitlines()
  title = lines[0].lstrip("# ").strip() if lines and lines[0].startswith("# ") else ""
  body = "\n".join(lines[1:] if title else lines)
  body = re.sub(r"^(#+) ", r"#\1 ", body, flags=re.M)
  rel = os.path.relpath(section_dir, out_dir)

  def rebase(m):
    target = m.group(2)
    if re.match(r"^[a-z]+://|^/", target):
      return m.group(0)
    return f"![{m.group(1)}]({os.path.join(rel, target)})"

  return title, re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", rebase, body)


def render_experiment(experiment: str, records: list[dict], out_dir: str) -> str:
  """Writes the experiment's own markdown and figures of ``records`` into ``out_dir`` (as its
  run does); returns the markdown's file name."""
  module, fn, md_name = RENDERERS[experiment]
  os.makedirs(out_dir, exist_ok=True)
  getattr(importlib.import_module(module), fn)(records, out_dir)
  return md_name


def render_group(experiment: str, records: list[dict], section_dir: str, out_dir: str) -> str:
  """The markdown section of one experiment's records (its renderer writes into section_dir)."""
  md_name = render_experiment(experiment, records, section_dir)
  md_path = os.path.join(section_dir, md_name)
  text = open(md_path, encoding="utf-8").read() if os.path.exists(md_path) else ""
  title, body = _embed(text, section_dir, out_dir)
  linked = set(re.findall(r"\]\(([^)]+)\)", body))
  for name in sorted(os.listdir(section_dir)):
    path = os.path.relpath(os.path.join(section_dir, name), out_dir)
    if name.endswith(".png") and path not in linked:
      body += f"\n\n![{name}]({path})"
  return f"## {title or experiment} (`{records[0]['source']}`)\n\n{body.strip()}"


def build(root: str, out_dir: str | None = None, name: str = "report.md") -> str:
  """Writes ``out_dir/name`` (default: ``root/report.md``) and its figures; returns the path."""
  out_dir = out_dir or root
  os.makedirs(out_dir, exist_ok=True)
  groups = collect(root)
  sources = sorted({source for source, _ in groups})
  models = sorted({str(r.get("model", r.get("config", {}).get("model", "?")))
                   for recs in groups.values() for r in recs})
  revs = sorted({r.get("git", "?") for recs in groups.values() for r in recs})
  sections = [f"Results from {len(sources)} file(s) under `{root}`: "
              + ", ".join(f"`{s}`" for s in sources) + f".\n\nModels: {', '.join(models)}."
              f" Git revisions: {', '.join(revs)}."]
  order = list(RENDERERS)
  unknown = []
  for (source, exp), recs in sorted(groups.items(), key=lambda kv: (
      order.index(kv[0][1]) if kv[0][1] in order else len(order), kv[0][0])):
    if exp not in RENDERERS:
      unknown.append(f"- `{exp}` in `{source}`: {len(recs)} records (no renderer)")
      continue
    workdir = os.path.dirname(source).replace(os.sep, "_") or "_root"
    sections.append(render_group(exp, recs, os.path.join(out_dir, "figures", exp, workdir),
                                 out_dir))
  if unknown:
    sections.append("## Other results\n\n" + "\n".join(unknown))
  return render.write_markdown(out_dir, name, "Sparse attention: experiments report", sections)
