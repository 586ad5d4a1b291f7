r"""Expected Attention's expected score per key against the question's true attention (needles).

  python -m experiments.ea_needle_diagnosis --config=configs/ea_needle_diagnosis.py \
      --workdir=results/ea_needle_diagnosis

See ``configs/ea_needle_diagnosis.py`` (protocol) and
``experiments/analysis/ea_needle_diagnosis.py``. Writes ``results.jsonl``,
``ea_needle_diagnosis.md`` and ``ea_needle_diagnosis.png``; a rerun resumes.
"""

from experiments.common import cli

cli.define_flags("ea_needle_diagnosis")


def main(argv):
  del argv
  config, workdir = cli.parsed()
  from experiments.analysis import ea_needle_diagnosis  # pylint: disable=g-import-not-at-top
  for row in ea_needle_diagnosis.run(config, workdir):
    print(row)


if __name__ == "__main__":
  cli.run(main)
