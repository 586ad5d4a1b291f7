r"""RESA lambda sweep on task accuracy: RESA Sec. 5.4, Fig. 7a.

  python -m experiments.resa_lambda --config=configs/resa_lambda.py --workdir=results/resa_lambda
  python -m experiments.resa_lambda --config=configs/resa_lambda.py --config.quick=True \
      --workdir=/tmp/resa_lambda_quick

RULER accuracy (``experiments.tasks.accuracy``, query-aware, greedy) of ``resa-quest`` at 2.5%
for lambda in {0, 0.25, 0.5, 0.75, 1} in both readings of the prior weight (renormalised and
the paper's literal alpha' = lam * alpha) on a retrieval task (``niah_multikey_2``: the paper's
left panel, accuracy rising with lambda) and an aggregation task (``cwe``: the right panel, the
prior pulling answers towards common words), against dense. 2k-token prompts keep the cost
down (at 2.5% the selector still chooses 4 blocks by score besides the 4 sinks and 64 local
tokens).

Samples: 50 per task, i.e. every (task, lambda, form) cell holds 50 paired samples.

Cost (2 cores, idle-machine estimate, see ``configs/accuracy.py``): ~25 s of shared prefill per
2k prompt (100 prompts, ~45 min) plus 9 rows x ~16 / 64 steps per 5-prompt batch (niah / cwe)
at ~0.5 s: ~1.2 h in all.
"""

from configs import accuracy


def get_config(quick: bool = False):
  c = accuracy.get_config(False)
  c.method = "resa-quest"
  c.budget = 0.025
  c.lambdas = (0.0, 0.25, 0.5, 0.75, 1.0)
  c.methods = ()
  c.budgets = ()
  c.pairs = ()
  c.tasks = ("niah_multikey_2", "cwe")
  c.lengths = (2048,)
  c.num_samples = 50
  c.batch_size = 5
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.budget = 0.1
  c.lambdas = (0.0, 0.5, 1.0)
  c.tasks = ("niah_single_1",)
  c.lengths = (320,)
  c.num_samples = 2
  c.batch_size = 2
  c.max_new_tokens = 6
  return c

