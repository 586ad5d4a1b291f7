r"""kvpress's RULER leaderboard, query-aware panel (``configs/leaderboard_compression.py``).

  python -m experiments.accuracy --config=configs/leaderboard_compression_qa.py \
      --workdir=results/leaderboard_compression_qa "--config.lengths=(4096,)"
"""

from configs import leaderboard_compression


def get_config(quick: bool = False):
  return leaderboard_compression.get_config(quick, panel="query_aware")
