r"""One markdown report of every experiment's JSONL results (see ``configs/report.py``).

  python -m experiments.report --config=configs/report.py --config.root=results --workdir=results
"""

from absl import logging

from experiments.common import cli

cli.define_flags("report")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from experiments.tasks import config_util, report  # pylint: disable=g-import-not-at-top
  config, workdir = cli.parsed()
  config = config_util.resolve(config, "report")
  path = report.build(config.root, workdir, config.name)
  print(open(path, encoding="utf-8").read())


if __name__ == "__main__":
  cli.run(main)
