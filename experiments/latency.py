r"""Decode-latency and memory benchmark: sparse methods vs dense vs PyTorch (issue 9).

  python -m experiments.latency --config=configs/latency.py --workdir=results/latency

See ``configs/latency.py`` for the sections and subsets; ``experiments/latency_lib`` measures.
"""

from __future__ import annotations

from experiments.common import cli

cli.define_flags("latency")


def main(argv):
  del argv
  from experiments import latency_lib  # pylint: disable=g-import-not-at-top
  config, workdir = cli.parsed()
  print(latency_lib.run(config, workdir))


if __name__ == "__main__":
  cli.run(main)
