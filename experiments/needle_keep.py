r"""Which context tokens each compression method keeps, and whether the needle survives.

  python -m experiments.needle_keep --config=configs/needle_keep.py --workdir=results/needle_keep

See ``configs/needle_keep.py`` (protocol) and ``experiments/analysis/needle_experiment.py``.
Writes ``results.jsonl``, ``needle_keep.md`` and ``needle_keep.png``; a rerun resumes.
"""

from experiments.common import cli

cli.define_flags("needle_keep")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.analysis import needle_experiment  # pylint: disable=g-import-not-at-top
  for row in needle_experiment.run(config, workdir):
    print(row)


if __name__ == "__main__":
  cli.run(main)
