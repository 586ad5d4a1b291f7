r"""One markdown report of every experiment's JSONL results (see ``configs/report.py``).

  python -m experiments.report --workdir=results   # report.md, and REPORT.md (the claims)

With the report written next to the records (``--workdir`` = ``--config.root``) the claims
report ``REPORT.md`` (``experiments.claims``) is rebuilt too.
"""

import os

from experiments.common import cli

cli.define_flags("report")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.tasks import report  # pylint: disable=g-import-not-at-top
  path = report.build(config.root, workdir, config.name)
  print(open(path, encoding="utf-8").read())
  if os.path.abspath(config.root) == os.path.abspath(workdir):
    from experiments import claims  # pylint: disable=g-import-not-at-top
    print(f"claims report: {claims.build(config.root)}")


if __name__ == "__main__":
  cli.run(main)
