r"""One markdown report of every experiment's JSONL results (see ``configs/report.py``).

  python -m experiments.report --config=configs/report.py --config.root=results --workdir=results
"""

from experiments.common import cli

cli.define_flags("report")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.tasks import report  # pylint: disable=g-import-not-at-top
  path = report.build(config.root, workdir, config.name)
  print(open(path, encoding="utf-8").read())


if __name__ == "__main__":
  cli.run(main)
