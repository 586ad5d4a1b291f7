r"""SVD of attention logits (RESA Sec. 3.2; Fig. 2, 4, 5b, 6b).

  python -m experiments.svd_analysis --config=configs/svd_analysis.py [--config.quick=True]

See ``configs/svd_analysis.py`` for the options and ``experiments/analysis/svd.py`` for the math.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("svd_analysis")
