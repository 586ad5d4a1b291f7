r"""RESA lambda sweep on retrieval-like and summary-like tasks (RESA Sec. 5.4, Fig. 7a).

  python -m experiments.resa_lambda --config=configs/resa_lambda.py [--config.quick=True]

See ``configs/resa_lambda.py`` (options) and ``experiments/analysis/quality.py`` (tasks).
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("resa_lambda")
