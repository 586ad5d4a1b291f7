"""The one entry point of every registered experiment (``experiments.registry``).

  python -m experiments NAME --config=configs/PART.py --workdir=results/PART
  python -m experiments.NAME ...        # the same: each experiments/NAME.py calls ``main(NAME)``

Defines the flags of ``experiments.common.cli`` (``--mesh`` where the experiment shards), runs
the experiment's ``run`` and prints the markdown it rendered into the workdir (a quick run's
says under its title that its scores are meaningless).
"""

from __future__ import annotations

import os

from absl import app

from experiments import registry
from experiments.common import cli


def main(name: str) -> None:
  """Parses the command line and runs experiment ``name`` (absl's ``app.run``)."""
  experiment = registry.get(name)
  cli.define_flags(name, mesh=experiment.mesh)

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}")
    options = {}
    if experiment.mesh:  # first: --distributed initialises before anything touches a device
      options["mesh"] = cli.mesh()
    config, workdir = cli.parsed()
    if experiment.long_context:
      options["allow_long_context"] = cli.ALLOW_LONG_CONTEXT.value
    registry.load(experiment.run)(config, workdir, **options)
    path = os.path.join(workdir, experiment.markdown)
    if os.path.exists(path):
      if config.get("quick", False):
        cli.mark_quick(path)
      print(open(path, encoding="utf-8").read())

  cli.run(run)
