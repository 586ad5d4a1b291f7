r"""Attention error vs dense, with and without RESA (RESA Sec. 5.3, Fig. 6a).

  python -m experiments.attention_error --config=configs/attention_error.py [--config.quick=True]

See ``configs/attention_error.py`` (options) and ``experiments/analysis/errors.py`` (protocol).
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("attention_error")
