"""Batches planned from device memory: fixed shapes, sub-batched compression prefill, OOM retry.

The pieces of ``experiments.tasks.accuracy``'s planned run (``--config.batch_plan=True``, the
GPU config ``configs/accuracy_gpu.py``), where each method runs on its own with the batch
``experiments.tasks.batch_plan`` chose for it:

* ``batches``: the samples of one length in batches of at most the planned size, balanced
  (28 samples at a plan of 13 run as 10 + 10 + 8, not 13 + 13 + 2), and ``padded`` to the same
  row count (the last rows repeat a sample and are dropped), so every batch of a method and
  length has one shape and the decode program compiles once;
* ``prefill``: the method's own prefill (no shared prefill, no copy of a cache). A compression
  method runs with a static ``decode_slots`` (``batch_plan.with_decode_slots``), so its
  compacted cache has one size whatever the prompts, and prefills in sub-batches of the plan's
  ``prefill_batch``: each sub-batch is prefilled in full, compressed, and only its compacted
  cache kept; the sub-batches' caches and states are then joined along the batch axis
  (``join``, the axis found from ``jax.eval_shape`` of ``end_prefill`` at two batch sizes), so
  a larger batch decodes than the full prompt caches would allow;
* ``is_oom``: a device out-of-memory error (the run halves its batch and tries again).

Letters: B batch, E hidden, T capacity.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments.tasks import batch_plan, decoding
from models import decode, steps


def batches(items: list, size: int) -> list[list]:
  """``items`` in consecutive batches of at most ``size``, as even as possible."""
  if not items:
    return []
  count = math.ceil(len(items) / max(1, size))
  per = math.ceil(len(items) / count)
  return [items[i:i + per] for i in range(0, len(items), per)]


def padded(rows: list, size: int) -> list:
  """``rows`` with its last entry repeated up to ``size`` entries (the extra rows are run and
  dropped: every batch then has the same shape)."""
  return list(rows) + [rows[-1]] * (size - len(rows))


def batch_axes(model_config, method, capacity: int, params=None):
  """A tree like ``(caches, states)`` after ``end_prefill``: True where a leaf's first axis is
  the batch (its size follows the batch size), False where it does not. ``params``: the
  weights a method's layer state reads (``steps.init_caches``; CriticalKV's W^O)."""
  cfg = model_config.for_context(capacity)

  def after(b):
    return jax.eval_shape(lambda: steps.end_prefill(
        *steps.init_caches(cfg, method, b, capacity, params), config=cfg, method=method))

  return jax.tree.map(lambda one, two: one.shape[:1] != two.shape[:1], after(1), after(2))


def join(parts: list, axes):
  """``parts`` (trees of one structure) joined along the batch axis where ``axes`` says so;
  other leaves must agree in shape and are taken from the first part."""
  if len(parts) == 1:
    return parts[0]

  def one(is_batch, *xs):
    if is_batch:
      return jnp.concatenate(xs, axis=0)
    if any(x.shape != xs[0].shape for x in xs):
      raise ValueError(f"a leaf without a batch axis differs between sub-batches: "
                       f"{[x.shape for x in xs]}")
    return xs[0]

  return jax.tree.map(one, axes, *parts)


def prefill(model, prompts: np.ndarray, lengths: np.ndarray, method, capacity: int, *,
            prefill_batch: int, prefill_chunk: int, question_length=None) -> decoding.Prefilled:
  """``method``'s own prefill of ``prompts [B, S]``: in one batch, or for a compression method
  (``batch_plan.splits_prefill``; pass it ``with_decode_slots``) in sub-batches of
  ``prefill_batch`` whose compacted caches are joined. ``question_length [B]`` as
  ``decode.prefill``'s."""
  b = len(lengths)
  if not batch_plan.splits_prefill(method) or prefill_batch >= b:
    return decoding.Prefilled(*decode.prefill(model, prompts, lengths, method, capacity,
                                              prefill_chunk, question_length=question_length),
                              lengths, capacity)
  if method.decode_slots is None:
    raise ValueError(f"{method.spec!r}: a sub-batched prefill needs the static decode_slots "
                     "(batch_plan.with_decode_slots), so every sub-batch compacts to one size")
  axes = batch_axes(model.config, method, capacity, model.decode_params)
  lasts, histories, trees = [], [], []
  for i in range(0, b, prefill_batch):
    rows = slice(i, i + prefill_batch)
    last, history, caches, states = decode.prefill(
        model, prompts[rows], lengths[rows], method, capacity, prefill_chunk,
        question_length=None if question_length is None else question_length[rows])
    lasts.append(last)
    histories.append(history)
    trees.append((caches, states))
  caches, states = join(trees, axes)
  return decoding.Prefilled(jnp.concatenate(lasts), jnp.concatenate(histories), caches, states,
                            lengths, capacity)


def is_oom(error: BaseException) -> bool:
  """Whether ``error`` is the device running out of memory (XLA's RESOURCE_EXHAUSTED)."""
  text = f"{type(error).__name__}: {error}"
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
