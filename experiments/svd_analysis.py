r"""SVD of attention logits (RESA Sec. 3.2; Fig. 2, 4, 5b, 6b).

  python -m experiments.svd_analysis --config=configs/svd_analysis.py [--config.quick=True]

See ``configs/svd_analysis.py`` for the options and ``experiments/analysis/svd.py`` for the math.
"""

from experiments.common import cli

cli.define_flags("svd_analysis")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.analysis import svd_experiment  # pylint: disable=g-import-not-at-top (heavy)
  for row in svd_experiment.run(config, workdir):
    print(row)


if __name__ == "__main__":
  cli.run(main)
