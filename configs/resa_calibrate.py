r"""Per-head RESA lambda (and bias slope) calibration with optax, saved with orbax.

  python -m experiments.resa_calibrate --config=configs/resa_calibrate.py
  python -m experiments.resa_calibrate --config=configs/resa_calibrate.py --config.quick=True \
      --workdir=/tmp/resa_calibrate_quick

Beyond the paper (RESA names task-dependent lambda as its open limitation): fit per-head
``log lambda`` (and optionally ``beta``, the slope of RESA's online bias) on a calibration novel
by minimising the attention-output error vs dense (oracle inputs, ``errors.simulate``), then
report the output error on a held-out novel and the held-out teacher-forced NLL vs lambda = 1
and vs the best single lambda.
"""

import ml_collections


def get_config(quick: bool = False):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  c.calib_text = "emma"
  c.heldout_text = "persuasion"
  c.prefill_len = 2048
  c.steps = 32  # decode steps measured (calibration and held-out error)
  c.chunk = 512
  c.method = "quest+resa"
  c.budget = 0.05
  c.block_size = 16
  c.opt_steps = 300
  c.learning_rate = 0.05
  c.variants = ("lambda", "lambda+beta")
  c.lam_grid = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
  c.nll_samples = 2  # held-out windows for NLL (0 = skip the NLL part)
  c.nll_cont = 32
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.prefill_len = 192
  c.steps = 8
  c.chunk = 64
  c.budget = 0.1
  c.opt_steps = 50
  c.variants = ("lambda+beta",)
  c.nll_samples = 1
  c.nll_cont = 4
  return c
