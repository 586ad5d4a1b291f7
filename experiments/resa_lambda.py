r"""RESA lambda sweep on retrieval-like and summary-like tasks (RESA Sec. 5.4, Fig. 7a).

  python -m experiments.resa_lambda --config=configs/resa_lambda.py [--config.quick=True]

See ``configs/resa_lambda.py`` (options) and ``experiments/analysis/quality.py`` (tasks).
"""

from experiments.common import cli

cli.define_flags("resa_lambda", mesh=True)  # --mesh=data:2,model:2,seq:2


def main(argv):
  del argv
  mesh = cli.mesh()  # first: --distributed initialises before anything touches a device
  config, workdir = cli.parsed()
  from experiments.analysis import lambda_experiment  # pylint: disable=g-import-not-at-top (heavy)
  for row in lambda_experiment.run(config, workdir, mesh=mesh):
    print(row)


if __name__ == "__main__":
  cli.run(main)
