r"""Smallest budget within 2% of dense, with and without RESA: RESA Sec. 5.5, Fig. 7b.

  python -m experiments.budget_reduction --config=configs/budget_reduction.py
  python -m experiments.budget_reduction --config=configs/budget_reduction.py \
      --config.quick=True --workdir=/tmp/budget_reduction_quick

Families: ``quest:topp`` (top-p / PSA block selection, knob = mass threshold tau, capped at
``topp_cap`` of the context) and ``quest:adakv`` (Ada-KV head-adaptive allocation, knob = the
mean budget, floor ``adakv_floor``). The budget a knob really spends is measured as the attended
fraction of the context on oracle inputs (``experiments/analysis/errors.py``); quality is
teacher-forced NLL relative to dense (``experiments/analysis/quality.py``).
"""

import ml_collections


def get_config(quick: bool = False):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  c.task = "longdoc"
  c.samples = 2
  c.ctx = 2048
  c.cont = 32
  c.seed = 0
  c.block_size = 16
  c.families = ("quest:topp", "quest:adakv")
  c.topp_taus = (0.5, 0.7, 0.8, 0.9, 0.95)
  c.topp_cap = 0.5
  c.adakv_budgets = (0.02, 0.035, 0.05, 0.075, 0.1)
  c.adakv_floor = 0.2
  c.resa_options = "lam=1.0"
  c.tolerance = 0.02  # quality >= (1 - tolerance) x dense
  c.budget_steps = 16  # decode steps for the measured budget
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.samples = 1
  c.ctx = 192
  c.cont = 8
  c.topp_taus = (0.9,)
  c.adakv_budgets = (0.1,)
  c.budget_steps = 4
  return c
