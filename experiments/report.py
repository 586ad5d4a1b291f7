r"""One markdown report of every experiment's JSONL results (see ``configs/report.py``).

  python -m experiments.report --workdir=results   # report.md, and REPORT.md (the claims)

With the report written next to the records (``--workdir`` = ``--config.root``) the claims
report ``REPORT.md`` (``experiments.claims``) is rebuilt too.

Records are grouped by results file and ``experiment`` field, and each group is rendered by its
experiment's own renderer (``experiments.registry``) into ``figures/<experiment>/<workdir>/``;
the renderer's markdown is embedded with its headings demoted and its figure links rebased, and
figures it does not link are appended. Experiments without a renderer are listed with their
record counts, so nothing is silently dropped.
"""

from __future__ import annotations

import collections
import os
import re

from experiments import registry
from experiments.common import cli, render, results

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


def render_experiment(experiment: registry.Experiment, records: list[dict], out_dir: str) -> str:
  """Writes the experiment's own markdown and figures of ``records`` into ``out_dir`` (as its
  run does); returns the markdown's file name."""
  os.makedirs(out_dir, exist_ok=True)
  registry.load(experiment.render)(records, out_dir)
  return experiment.markdown


def render_group(experiment: registry.Experiment, records: list[dict], section_dir: str,
                 out_dir: str) -> str:
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
  return f"## {title or experiment.name} (`{records[0]['source']}`)\n\n{body.strip()}"


def build(root: str, out_dir: str | None = None, name: str = "report.md",
          experiments=registry.EXPERIMENTS) -> str:
  """Writes ``out_dir/name`` (default: ``root/report.md``) and its figures; returns the path.
  ``experiments``: the registry whose renderers draw the records."""
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
  known = registry.by_name(experiments)
  order = list(known)
  unknown = []
  for (source, exp), recs in sorted(groups.items(), key=lambda kv: (
      order.index(kv[0][1]) if kv[0][1] in order else len(order), kv[0][0])):
    if exp not in known:
      unknown.append(f"- `{exp}` in `{source}`: {len(recs)} records (no renderer)")
      continue
    workdir = os.path.dirname(source).replace(os.sep, "_") or "_root"
    sections.append(render_group(known[exp], recs, os.path.join(out_dir, "figures", exp, workdir),
                                 out_dir))
  if unknown:
    sections.append("## Other results\n\n" + "\n".join(unknown))
  return render.write_markdown(out_dir, name, "Sparse attention: experiments report", sections)


def main(argv):
  del argv
  config, workdir = cli.parsed()
  path = build(config.root, workdir, config.name)
  print(open(path, encoding="utf-8").read())
  if os.path.abspath(config.root) == os.path.abspath(workdir):
    from experiments.claims import report as claims  # pylint: disable=g-import-not-at-top
    print(f"claims report: {claims.build(config.root)}")


if __name__ == "__main__":
  cli.define_flags("report")
  cli.run(main)
