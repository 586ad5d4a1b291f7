r"""RESA lambda sweep on retrieval-like and summary-like tasks: RESA Sec. 5.4, Fig. 7a.

  python -m experiments.resa_lambda --config=configs/resa_lambda.py
  python -m experiments.resa_lambda --config=configs/resa_lambda.py --config.quick=True \
      --workdir=/tmp/resa_lambda_quick

Quality is teacher-forced NLL (``experiments/analysis/quality.py``): ``squad`` (answer tokens
after a haystack of SQuAD paragraphs; retrieval-like) and ``longdoc`` (continuation of an
Austen novel; summary-like), relative to dense.
"""

import ml_collections


def get_config(quick: bool = False):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"
  c.tasks = ("squad", "longdoc")
  c.samples = 4  # per task
  c.ctx = 2048  # prompt tokens (haystack / document)
  c.cont = 32  # longdoc: continuation tokens scored
  c.seed = 0
  c.method = "quest+resa"
  c.budget = 0.05
  c.block_size = 16
  c.lambdas = (0.0, 0.25, 0.5, 0.75, 1.0)
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.samples = 1
  c.ctx = 128
  c.cont = 4
  c.budget = 0.1
  c.lambdas = (1.0,)
  return c
