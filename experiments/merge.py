r"""Merges the records of parallel runs of one config into a workdir, then re-renders it.

  python -m experiments.merge --into=results/accuracy_compression /runs/a /runs/b.jsonl

Each source is a workdir (its ``results.jsonl``) or a JSONL file, e.g. runs of the same config
split by task or length across processes. A record already in the target (same experiment,
config fingerprint and key) is skipped, so merging twice adds nothing; a source of another config
fingerprint is refused. The target is rewritten with each run's config stored once
(``results.write_records``) and its own markdown and figures re-rendered; rebuild the claims
report afterwards with ``python -m experiments.report --workdir=results``.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import registry, report
from experiments.common import cli, results

FLAGS = flags.FLAGS
_INTO = flags.DEFINE_string("into", None, "Workdir to merge into (created if absent).",
                            required=True)


def _path(source: str) -> str:
  path = os.path.join(source, results.RESULTS_FILE) if os.path.isdir(source) else source
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no results at {source}")
  return path


def merge(into: str, sources: list[str]) -> dict[str, int]:
  """Merges ``sources`` into ``into``, re-renders it; source -> records added."""
  target = os.path.join(into, results.RESULTS_FILE)
  merged, added = results.merge_records(
      results.read_records(target), {s: results.read_records(_path(s)) for s in sources})
  os.makedirs(into, exist_ok=True)
  results.write_records(target, merged)
  known = registry.by_name()
  for exp in sorted({r.get("experiment") for r in merged}):
    if exp in known:
      report.render_experiment(known[exp], [r for r in merged if r.get("experiment") == exp],
                               into)
  return added


def main(argv):
  sources = argv[1:]
  if not sources:
    raise ValueError("give at least one source workdir or JSONL file to merge")
  for source, n in merge(_INTO.value, sources).items():
    print(f"{source}: {n} records added")
  total = len(results.read_records(os.path.join(_INTO.value, results.RESULTS_FILE)))
  print(f"{_INTO.value}: {total} records")


if __name__ == "__main__":
  cli.run(main)
