r"""Decode-latency and memory benchmark: sparse methods vs dense vs PyTorch (issue 9).

  python -m experiments.latency --config=configs/latency.py --workdir=results/latency

See ``configs/latency.py`` for the sections and subsets; ``experiments/latency_lib`` measures.
"""

from experiments import entry

if __name__ == "__main__":
  entry.main("latency")
