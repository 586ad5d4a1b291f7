r"""Per-head RESA lambda calibration with optax + orbax (beyond the paper).

  python -m experiments.resa_calibrate --config=configs/resa_calibrate.py [--config.quick=True]

See ``configs/resa_calibrate.py`` (options) and ``experiments/analysis/calibrate.py`` (method).
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("resa_calibrate")
