r"""Smallest budget within 2% of dense with and without RESA (RESA Sec. 5.5, Fig. 7b).

  python -m experiments.budget_reduction --config=configs/budget_reduction.py [--config.quick=True]

See ``configs/budget_reduction.py`` (options) and ``experiments/analysis/quality.py`` (tasks).
"""

from experiments.common import cli

cli.define_flags("budget_reduction", mesh=True)  # --mesh=data:2,model:2,seq:2


def main(argv):
  del argv
  mesh = cli.mesh()  # first: --distributed initialises before anything touches a device
  config, workdir = cli.parsed()
  from experiments.analysis import budget_experiment  # pylint: disable=g-import-not-at-top (heavy)
  for row in budget_experiment.run(config, workdir, mesh=mesh):
    print(row)


if __name__ == "__main__":
  cli.run(main)
