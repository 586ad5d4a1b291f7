r"""Smallest budget within 2 points of dense accuracy, with and without RESA: RESA Fig. 7b.

  python -m experiments.budget_reduction --config=configs/budget_reduction.py \
      --workdir=results/budget_reduction
  python -m experiments.budget_reduction --config=configs/budget_reduction.py \
      --config.quick=True --workdir=/tmp/budget_reduction_quick

Families: ``quest:topp`` (top-p / PSA block selection, knob = mass threshold tau, capped at
``topp_cap`` of the context) and ``quest:adakv`` (Ada-KV head-adaptive allocation, knob = the
mean budget, floor ``adakv_floor``), each with and without ``+resa``. Quality is the RULER
accuracy of one retrieval task (``experiments.tasks.accuracy``: the same prompts for every row,
one shared prefill); the budget a knob really spends is measured as the attended fraction of the
context on oracle inputs of the first prompt (``experiments/analysis/errors.py``).

Samples: 50 prompts of ``niah_multikey_2`` at 2k tokens (every row's accuracy is over the
same 50).

Cost (2 cores, idle-machine estimate, see ``configs/accuracy.py``): ~25 s of shared prefill per
2k prompt (~20 min) plus 21 rows x 16 steps per 5-prompt batch at ~0.5 s (~3 min per batch,
~30 min), plus one oracle capture of the first prompt: ~1 h in all.
"""

from configs import accuracy


def get_config(quick: bool = False):
  c = accuracy.get_config(False)
  c.methods = ()
  c.budgets = ()
  c.pairs = ()
  c.tasks = ("niah_multikey_2",)
  c.lengths = (2048,)
  c.num_samples = 50
  c.batch_size = 5
  c.families = ("quest:topp", "quest:adakv")
  c.topp_taus = (0.5, 0.7, 0.8, 0.9, 0.95)
  c.topp_cap = 0.5
  c.adakv_budgets = (0.02, 0.035, 0.05, 0.075, 0.1)
  c.adakv_floor = 0.2
  c.resa_options = "lam=1.0"
  c.tolerance = 0.02  # accuracy >= dense - tolerance (absolute)
  c.budget_steps = 16  # decode steps for the measured budget
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.tasks = ("niah_single_1",)
  c.lengths = (320,)
  c.num_samples = 2
  c.batch_size = 2
  c.max_new_tokens = 6
  c.topp_taus = (0.9,)
  c.adakv_budgets = (0.1,)
  c.budget_steps = 4
  return c
