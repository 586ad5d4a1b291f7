r"""Smallest budget within 2% of dense with and without RESA (RESA Sec. 5.5, Fig. 7b).

  python -m experiments.budget_reduction --config=configs/budget_reduction.py [--config.quick=True]

See ``configs/budget_reduction.py`` (options) and ``experiments/analysis/quality.py`` (tasks).
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("budget_reduction")
