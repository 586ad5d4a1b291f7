"""Calibrations a method computes from the model, not trained: Q-Filters' query SVD and
DuoAttention's on-the-fly head scores.

Q-Filters (Godey et al. 2025, arXiv 2503.02812, Sec. 3) fixes one filter per layer and kv head
from the SVD of the model's queries on a calibration text. The authors' ``make_filters.py``
samples 3,000 queries of 20 sequences of 2,048 tokens of a pretraining corpus; here the text is
the first ``length`` tokens of the offline Jane Austen novels (``experiments.common.data``,
``/work``-independent: the package data described in the data README), one dense prefill of the
model (``experiments.common.capture``: the post-RoPE queries of every layer, as the authors'
patched models return them), 3,000 queries sampled per head. Computed once per model and text
and cached as ``.npz`` under ``$SPARSE_ATTN_CACHE`` (default ``~/.cache/sparse_attn``).

DuoAttention on the fly (kvpress's ``duo_attention_on_the_fly``, arXiv 2410.10819) scores each
(layer, kv head) from the mean pre-RoPE query and key of a text (``duo_attention.head_scores``),
averaged over samples: kvpress draws 50 BookSum chapters; here ``samples`` consecutive pieces of
``length`` tokens of the same Austen text, each its own dense prefill (the captured post-RoPE
vectors rotated back by their positions).

Runs apply them through ``experiments.common.specs.build(..., model=)`` / ``for_model`` (the
CLI, the accuracy harness): a method built for a model gets its table unless its spec says
``calibration=prompt``. The disk cache is keyed by the model's config and a sample of its weights.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from sparse_attn.compression import duo_attention
from sparse_attn.compression import qfilters as qfilters_lib


def _fingerprint(model) -> str:
  """The model's config and a sample of its weights (the first 256 values of every tensor):
  two checkpoints of one architecture (a base model and its instruct tune, two random seeds)
  get their own tables."""
  import jax  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256(repr(model.config).encode())
  for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(model.params),
                           key=lambda x: jax.tree_util.keystr(x[0])):
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.asarray(leaf.reshape(-1)[:256], np.float32).tobytes())
  return h.hexdigest()[:16]


def _cache_path(model, what: str, text: str, length: int, samples: int) -> str:
  key = _fingerprint(model)
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
  from experiments.common import capture  # pylint: disable=g-import-not-at-top (heavy)
  cap = capture.capture(model, capture.text_tokens(model, text, length))
  kv = cap.k.shape[1]
  table = np.stack([qfilters_lib.filters_from_queries(cap.q[layer], kv, samples, seed)
                    for layer in range(cap.num_layers)])
  os.makedirs(os.path.dirname(path), exist_ok=True)
  np.savez(path, filters=table)
  return table


def duo_head_scores(model, text: str = "austen", length: int = 1024, samples: int = 8,
                    num_positions: int = 500) -> np.ndarray:
  """``[L, K]`` float32 DuoAttention on-the-fly head scores of ``model`` (cached on disk)."""
  path = _cache_path(model, f"duo{num_positions}", text, length, samples)
  if os.path.exists(path):
    return np.load(path)["scores"]
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from experiments.common import capture  # pylint: disable=g-import-not-at-top (heavy)
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  from sparse_attn.compression import rope  # pylint: disable=g-import-not-at-top
  inv_freq = np.asarray(modelzoo.rope_inv_freq(model), np.float32)
  tokens = capture.text_tokens(model, text, length * samples)
  pos = jnp.arange(length)
  total = 0.0
  for i in range(samples):
    cap = capture.capture(model, tokens[i * length:(i + 1) * length])
    # [L, N | K, D] mean pre-RoPE vectors (RoPE is linear: rotate back, then average)
    q, k = (np.asarray(rope.rotate_by(jnp.asarray(x), -pos, inv_freq)).mean(2)
            for x in (cap.q, cap.k))
    total = total + np.asarray(duo_attention.head_scores(q, k, inv_freq, num_positions))
  table = (total / samples).astype(np.float32)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  np.savez(path, scores=table)
  return table


def calibrate(method, model):
  """``method`` with what it calibrates from ``model``: a Q-Filters method that reads a
  calibration text (not ``calibration="prompt"``) gets its filter table, DuoAttention on the
  fly its head-score table; others unchanged."""
  if getattr(method, "name", None) == duo_attention.DuoAttention.name and (
      method.calibration != "prompt" and method.table is None):
    return method.with_head_scores(duo_head_scores(model, num_positions=method.num_positions))
  if getattr(method, "name", None) == "qfilters" and method.calibration != "prompt" and (
      method.filters is None):
    return method.with_filters(qfilters(model))
  return method
