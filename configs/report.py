r"""One markdown report of all JSONL results under a directory (experiments/report.py).

  python -m experiments.report --config=configs/report.py --config.root=results \
      --workdir=results
  python -m experiments.report --config=configs/report.py --config.quick=True  # CI

Writes ``WORKDIR/report.md`` with every experiment's tables and figures under
``WORKDIR/figures/``.
"""

from ml_collections import config_dict


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.root = "results"  # searched recursively for results.jsonl
  c.name = "report.md"
  if quick:
    c.root = "results"
  return c
