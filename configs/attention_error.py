r"""Attention error of sparse methods vs dense, with and without RESA: RESA Sec. 5.3, Fig. 6a.

  python -m experiments.attention_error --config=configs/attention_error.py
  python -m experiments.attention_error --config=configs/attention_error.py --config.quick=True \
      --workdir=/tmp/attention_error_quick

Every layer gets the dense model's own q/k/v of a real text ("oracle inputs",
``experiments/analysis/errors.py``): the method prefills ``prefill_len`` tokens and decodes the
next ``steps`` through its public per-layer functions; each step is compared with exact
attention. ``selectors x budgets`` run with and without ``+resa``; ``extra`` specs run at
``extra_budgets``. Every ``+resa`` record also splits RESA's output error into its two estimates
(``experiments/analysis/resa_decomposition.py``): the true unselected mass with RESA's residual
value, RESA's mass with the true residual value, and the estimated / true unselected mass
(median and correlation per head). Records written before that split render without it; to get
it, run into a fresh workdir, e.g. SmolLM2 and Qwen2.5-Coder-0.5B side by side:

  python -m experiments.attention_error --config=configs/attention_error.py \
      "--config.extra=()" --workdir=/tmp/attention_error_smollm2
  python -m experiments.attention_error --config=configs/attention_error.py \
      "--config.extra=()" --config.model=qwen2.5-coder-0.5b-instruct \
      --workdir=/tmp/attention_error_qwen
"""

import ml_collections


def get_config(quick: bool = False):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  c.text = "austen"
  c.skip_chars = 0
  c.prefill_len = 4096
  c.steps = 32
  c.chunk = 512
  c.block_size = 16
  c.selectors = ("quest", "arkvale", "topk")
  c.budgets = (0.025, 0.05, 0.1)
  c.resa_options = "lam=1.0"  # inline options of +resa
  c.extra = ("quest+retro:w=4", "quest+rect:f=16", "quest+resa+retro:w=4")
  c.extra_budgets = (0.05,)
  c.heatmap_budget = 0.05  # Fig. 6a heatmaps at this budget
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.prefill_len = 256
  c.steps = 4
  c.chunk = 128
  c.selectors = ("quest",)
  c.budgets = (0.1,)
  c.extra = ("quest+resa:lam=0.0", "quest+retro:w=2")
  c.extra_budgets = (0.1,)
  c.heatmap_budget = 0.1
  return c
