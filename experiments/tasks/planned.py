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
* ``is_oom``: a device out-of-memory error (the run halves its batch and tries again);
  ``each_batch`` runs a list of items in the plan's batches that way;
* ``Options``: the planned run's config fields, read in one place;
* teacher forcing (``decoding.lockstep``, the perplexity and long-generation experiments):
  ``lockstep_groups`` splits the methods into groups that run side by side with the
  reference, as many in a group as fit one sample beside it (the group's bytes are the sum of
  its methods', ``batch_plan.combined``), each group with its batch planned;
  ``prefiller`` prefills each method of a group on its own (``prefill``, chunked).

Letters: B batch, E hidden, T capacity.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

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


# -> ``greedy`` / ``lockstep``'s ``fused``: one device program (GPU default), per-layer calls
DECODE_STEPS = {"auto": None, "program": True, "per_layer": False}


@dataclasses.dataclass(frozen=True)
class Options:
  """The planned run's config fields (``configs/accuracy_gpu.py`` documents them).

  ``lockstep_methods``: at most this many methods beside the reference in one lockstep group
  (0: as many as fit).
  """

  batch_size: int = 0
  prefill_batch: int = 0
  memory_margin: float = 0.1
  prefill_chunk: int = 512
  decode_step: str = "auto"
  lockstep_methods: int = 0

  @classmethod
  def of(cls, config) -> "Options":
    opts = cls(**{f.name: config.get(f.name, f.default) for f in dataclasses.fields(cls)})
    if opts.decode_step not in DECODE_STEPS:
      raise ValueError(f"decode_step must be one of {tuple(DECODE_STEPS)}, "
                       f"got {opts.decode_step!r}")
    return opts

  @property
  def fused(self) -> bool | None:
    return DECODE_STEPS[self.decode_step]

  @property
  def step_name(self) -> str:
    """The decode step that runs here: ``program`` or ``per_layer``."""
    return "program" if (steps.fused_by_default() if self.fused is None else self.fused) \
        else "per_layer"

  def plan(self, model, methods, *, capacity: int, longest_prompt: int, max_batch: int,
           override: int | None = None) -> batch_plan.BatchPlan:
    """``batch_plan.plan`` of ``methods`` (one, or a group side by side) under these options."""
    return batch_plan.plan(model, methods, capacity=capacity, longest_prompt=longest_prompt,
                           prefill_chunk=self.prefill_chunk, max_batch=max_batch,
                           margin_fraction=self.memory_margin,
                           override=self.batch_size if override is None else override,
                           prefill_override=self.prefill_batch)


@dataclasses.dataclass(frozen=True)
class Ran:
  """One batch that ``each_batch`` ran: its ``rows`` (the items; the run saw them padded to
  ``size``), what ``run`` returned, the plan it ran under and the OOM retries so far."""

  rows: list
  result: object
  size: int
  plan: batch_plan.BatchPlan
  retries: int
  index: int
  seconds: float


def each_batch(items: list, plan: batch_plan.BatchPlan, run: Callable, *, label: str = ""):
  """Yields a ``Ran`` per batch of ``items`` in the plan's batches (``batches``), each batch
  run as ``run(rows padded to one size, plan)``; a batch that runs out of device memory halves
  the plan and the items left start over in the smaller batches."""
  pending, retries, index = list(items), 0, 0
  while pending:
    parts = batches(pending, plan.batch)
    size = len(parts[0])  # every batch padded to it: one shape, one compiled program
    for rows in parts:
      t0 = time.perf_counter()
      try:
        out = run(padded(rows, size), plan)
      except Exception as err:  # pylint: disable=broad-except (a device OOM is retried)
        if not is_oom(err) or plan.batch == 1:
          raise
        plan, retries = plan.halved(), retries + 1
        print(f"{label}: out of device memory at batch {size}; retrying at {plan.batch}",
              flush=True)
        break
      yield Ran(rows, out, size, plan, retries, index, time.perf_counter() - t0)
      pending, index = pending[len(rows):], index + 1


def lockstep_groups(model, methods: dict, reference: str, options: Options, *, capacity: int,
                    longest_prompt: int, max_batch: int) -> list[tuple[dict, batch_plan.BatchPlan]]:
  """``methods`` (label -> method, ``reference`` among them) in lockstep groups, each the
  reference and the next methods in order while a batch of ``options.batch_size`` (or one)
  sample of the group fits; each group with its plan. Compression methods get their static
  ``decode_slots`` (``batch_plan.with_decode_slots``)."""
  sized = {k: batch_plan.with_decode_slots(m, m.round_capacity(capacity), longest_prompt)
           for k, m in methods.items()}
  kw = dict(capacity=capacity, longest_prompt=longest_prompt, max_batch=max_batch)
  need = max(1, options.batch_size)

  def fits(labels):
    try:
      return options.plan(model, [sized[k] for k in labels], override=0, **kw).batch >= need
    except batch_plan.DoesNotFit:
      return False

  groups, group = [], [reference]
  for k in (k for k in sized if k != reference):
    full = options.lockstep_methods and len(group) > options.lockstep_methods
    if len(group) > 1 and (full or not fits(group + [k])):
      groups.append(group)
      group = [reference]
    group.append(k)
  groups.append(group)
  return [({k: sized[k] for k in g}, options.plan(model, [sized[k] for k in g], **kw))
          for g in groups]


def prefiller(model, plan: batch_plan.BatchPlan, options: Options) -> Callable:
  """``decoding.lockstep``'s ``prefill``: each method on its own through ``prefill`` (chunks of
  ``options.prefill_chunk``; compression in the plan's sub-batches)."""
  def each(methods, prompts, lengths, capacity):
    for m in methods:
      yield m, prefill(model, prompts, lengths, m, m.round_capacity(capacity),
                       prefill_batch=plan.prefill_batch, prefill_chunk=options.prefill_chunk)
  return each
