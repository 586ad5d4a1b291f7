r"""Attention error vs dense, with and without RESA (RESA Sec. 5.3, Fig. 6a).

  python -m experiments.attention_error --config=configs/attention_error.py [--config.quick=True]

See ``configs/attention_error.py`` (options) and ``experiments/analysis/errors.py`` (protocol).
"""

from experiments.common import cli

cli.define_flags("attention_error")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.analysis import error_experiment  # pylint: disable=g-import-not-at-top (heavy)
  for row in error_experiment.run(config, workdir):
    print(row)


if __name__ == "__main__":
  cli.run(main)
