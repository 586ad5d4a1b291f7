"""``python -m experiments NAME [flags]``: runs a registered experiment (``experiments.entry``).

``python -m experiments`` alone lists the experiments and their default runs.
"""

import sys

from experiments import entry, registry


def _usage() -> str:
  rows = [f"  {e.name:<22} configs: {', '.join(p.name for p in e.parts) or e.name}"
          for e in registry.EXPERIMENTS]
  return "usage: python -m experiments NAME [--config=...] [--workdir=...]\n" + "\n".join(rows)


if __name__ == "__main__":
  if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
    print(_usage(), file=sys.stderr)
    sys.exit(2)
  name = sys.argv.pop(1)
  if name not in registry.by_name():
    print(f"experiments: error: unknown experiment {name!r}\n{_usage()}", file=sys.stderr)
    sys.exit(2)
  entry.main(name)
