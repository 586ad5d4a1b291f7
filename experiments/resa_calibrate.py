r"""Per-head RESA lambda calibration with optax + orbax (beyond the paper).

  python -m experiments.resa_calibrate --config=configs/resa_calibrate.py [--config.quick=True]

See ``configs/resa_calibrate.py`` (options) and ``experiments/analysis/calibrate.py`` (method).
"""

from experiments.common import cli

cli.define_flags("resa_calibrate")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.analysis import calibrate_experiment  # pylint: disable=g-import-not-at-top (heavy)
  for row in calibrate_experiment.run(config, workdir):
    print(row)


if __name__ == "__main__":
  cli.run(main)
