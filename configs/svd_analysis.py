r"""SVD of attention logits on a real text: RESA Sec. 3.2, Fig. 2, 4, 5b, 6b.

  python -m experiments.svd_analysis --config=configs/svd_analysis.py
  python -m experiments.svd_analysis --config=configs/svd_analysis.py --config.quick=True \
      --workdir=/tmp/svd_quick

Spectra are exact and cheap for every layer and head (``M = scale Q K^T`` has rank <= D, see
``experiments/analysis/svd.py``); ``dense_check`` runs the explicit ``jnp.linalg.svd`` of the
``S x S`` matrix on a subset to confirm it.
"""

import ml_collections


def get_config(quick: bool = False):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"  # or an HF directory, or "tiny-random"
  c.text = "austen"  # experiments.common.data.long_text source
  c.skip_chars = 0
  c.lengths = (512, 1024, 2048, 4096, 8192)  # context lengths (prefixes of one capture)
  c.layers = ()  # () = every layer
  c.chunk = 512  # capture prefill chunk
  # Explicit dense SVD (float32 svdvals of the S x S matrix) on a subset, as a check:
  # (length, layer stride, heads per layer); heads are the first ones of each checked layer.
  c.dense_check = ((512, 3, 9), (1024, 3, 3), (2048, 10, 1), (4096, 30, 1))
  # Fig. 4a: per-key historical logits, at this length, every layer.
  c.concentration_len = 2048
  c.hist_range = 8.0
  c.hist_bins = 81
  # Fig. 6b: delta autocorrelation: prompt of delta_prefix tokens, delta_steps decode steps.
  c.delta_prefix = 2048
  c.delta_steps = 256
  c.max_lag = 64
  c.quick = quick
  return _apply_quick(c) if quick else c


def _apply_quick(c):
  """The quick (CI) values: ``get_config(quick=True)``, resolved by ``experiments.common.quick``."""
  c.model = "tiny-random"
  c.lengths = (64, 128, 256)
  c.chunk = 128
  c.dense_check = ((64, 1, 6), (128, 2, 2))
  c.concentration_len = 128
  c.delta_prefix = 128
  c.delta_steps = 64
  c.max_lag = 8
  return c
