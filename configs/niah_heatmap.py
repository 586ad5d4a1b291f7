r"""Needle in a haystack, depth x length, at 50% compression (Expected Attention Fig. 3).

  python -m experiments.accuracy --config=configs/niah_heatmap.py --workdir=results/niah_heatmap
  python -m experiments.accuracy --config=configs/niah_heatmap.py --workdir=results/niah_heatmap \
      "--config.lengths=(4096,)"  # one column first
  python -m experiments.accuracy --config=configs/niah_heatmap.py --config.quick=True

Protocol: Kamradt's needle (a number) in Paul Graham essays (``niah_single_2``), the context
compressed before the question (query-agnostic), ratio 0.5 (kept fraction 0.5), Expected
Attention with eps = 0 (the paper's needle setting, PROTOCOL_NOTES) against the six baselines.
``accuracy.md`` gets ``niah_heatmap.png`` (one depth x length grid per method, its mean in the
title) and the paired EA-vs-baseline differences.

Samples: ``depths`` x ``num_samples`` per length: 6 depths x 3 seeds x 3 lengths = 54 per
method (the headline cell: the whole heatmap's mean).

Cost (2 cores, idle-machine estimate, see ``configs/accuracy.py``): prefill of 18 prompts per
length (~25 / 55 / 110 s per prompt at 1k / 2k / 4k with H2O's scores) ~1 h, plus 8 rows x
~45 steps (question + 16-token answer) per 6-prompt batch at ~0.5 s: ~1.5 h in all.
"""

from configs import accuracy_compression


def get_config(quick: bool = False):
  c = accuracy_compression.get_config(quick)
  c.heatmap = True
  ea = "expected-attention:eps=0"
  c.methods = ("dense", ea) + accuracy_compression.BASELINES
  c.pairs = tuple((ea, b) for b in accuracy_compression.BASELINES)
  c.budgets = (0.5,)
  c.tasks = ("niah_single_2",)
  c.lengths = (1024, 2048, 4096)
  c.depths = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
  c.num_samples = 18  # 3 per depth
  c.batch_size = 6
  if quick:
    c.methods = ("dense", ea, "snapkv")
    c.pairs = ((ea, "snapkv"),)
    c.lengths = (192, 256)
    c.depths = (0.0, 1.0)
    c.num_samples = 2
    c.batch_size = 2
  return c
