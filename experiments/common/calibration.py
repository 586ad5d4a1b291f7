"""Calibrations a method computes from the model, not trained: Q-Filters' query SVD.

Q-Filters (Godey et al. 2025, arXiv 2503.02812, Sec. 3) fixes one filter per layer and kv head
from the SVD of the model's queries on a calibration text. The authors' ``make_filters.py``
samples 3,000 queries of 20 sequences of 2,048 tokens of a pretraining corpus; here the text is
the first ``length`` tokens of the offline Jane Austen novels (``experiments.common.data``,
``/work``-independent: the package data described in the data README), one dense prefill of the
model (``experiments.analysis.capture``: the post-RoPE queries of every layer, as the authors'
patched models return them), 3,000 queries sampled per head. Computed once per model and text
and cached as ``.npz`` under ``$SPARSE_ATTN_CACHE`` (default ``~/.cache/sparse_attn``).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from sparse_attn.compression import qfilters as qfilters_lib


def _cache_path(model, what: str, text: str, length: int, samples: int) -> str:
  key = hashlib.sha256(repr(model.config).encode()).hexdigest()[:16]
  root = os.environ.get("SPARSE_ATTN_CACHE", os.path.expanduser("~/.cache/sparse_attn"))
  return os.path.join(root, "calibration", f"{what}-{key}-{text}-{length}-{samples}.npz")


def qfilters(model, text: str = "austen", length: int = 4096, samples: int = 3000,
             seed: int = 0) -> np.ndarray:
  """``[L, K, D]`` float32 Q-Filters of ``model`` from ``length`` tokens of ``text``.

  Cached on disk: the same model config, text, length and sample count read the saved table.
  """
  path = _cache_path(model, "qfilters", text, length, samples)
  if os.path.exists(path):
    return np.load(path)["filters"]
  from experiments.analysis import capture  # pylint: disable=g-import-not-at-top (heavy)
  cap = capture.capture(model, capture.text_tokens(model, text, length))
  kv = cap.k.shape[1]
  table = np.stack([qfilters_lib.filters_from_queries(cap.q[layer], kv, samples, seed)
                    for layer in range(cap.num_layers)])
  os.makedirs(os.path.dirname(path), exist_ok=True)
  np.savez(path, filters=table)
  return table


def calibrate(method, model):
  """``method`` with what it calibrates from ``model``: a Q-Filters method that reads a
  calibration text (not ``calibration="prompt"``) gets its filter table; others unchanged."""
  if getattr(method, "name", None) == "qfilters" and method.calibration != "prompt" and (
      method.filters is None):
    return method.with_filters(qfilters(model))
  return method
