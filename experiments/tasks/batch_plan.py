"""The batch a method's accuracy run fits on the device: bytes per sample against free memory.

Letters: B decode batch, b prefill batch, T cache capacity, c prefill chunk, L layers, E hidden,
F MLP size, N query / K kv heads, D head dim.

A batch of ``B`` samples of one method at one capacity holds on the device

  weights + other + per_layer + B * kept + b * transient + margin  <=  device bytes

* ``kept`` (per sample, exact: ``jax.eval_shape`` of the method's own ``init_cache`` /
  ``init_state`` at ``T``, every layer): the cache and method state that live while the batch
  decodes (K/V, slot positions, block digests, RESA's prior, retro's ring ...). For a
  compression method it is the *compacted* cache and state after ``end_prefill`` (the
  ``eval_shape`` of ``steps.end_prefill`` with the static ``decode_slots`` that the planned run
  also sets, so the sizes are the ones it allocates);
* ``transient`` (per sample, while it is prefilled): the activations of one prefill chunk
  (``c (3E + (N + 2K) D + N D + 3F)`` elements in the compute dtype, the f32 logits of one
  attention tile, the last hidden state and the LM head's row) and, for a compression method,
  the full prompt cache and state it compresses from plus its scoring scratch (an observation
  window's f32 attention over the prompt, ``2 N W T``, and f32 keys, ``K T D``, one layer at a
  time);
* ``per_layer`` (once, whatever the batch): state a run's ``layer_state`` adds per layer with
  no batch axis (CriticalKV's ``W^O [N, D, E]`` in the weights' dtype, held while it
  prefills): ``init_caches`` with the weights' shapes less the per-sample bytes;
* ``b``: a compression method prefills in sub-batches of ``b`` and keeps only the compacted
  caches of the rest (``experiments.tasks.planned``), so its decode batch is bounded by its
  compacted bytes; every other method prefills its whole batch (``b = B``), its prompt cache
  being the cache it decodes with;
* ``margin``: ``memory_margin`` of the device's bytes plus 1 GiB (compiler scratch, XLA's
  temporaries, fragmentation; the activations above are an estimate, not a measurement).

``choose`` takes the largest ``B`` (at most the samples there are) and then the largest ``b``
that fit; an override (``--config.batch_size``) wins, and a plan that cannot fit one sample
raises ``DoesNotFit`` naming the bytes. The run records the plan next to the device's peak
memory (``peak_bytes``; None where the backend reports none, e.g. a CPU), so the estimate can
be checked against what a GPU measured.
"""

from __future__ import annotations

import dataclasses

GIB = 1 << 30
FIXED_MARGIN = GIB
OBSERVATION_WINDOW = 64  # SnapKV's window: the largest scoring scratch among the presses here


class DoesNotFit(ValueError):
  """Not even one sample of the method fits the device."""


@dataclasses.dataclass(frozen=True)
class SampleBytes:
  """Device bytes of one sample: ``kept`` while decoding, ``transient`` while prefilled.

  ``split``: whether the prefill may run in sub-batches (compression: the compacted caches of
  sub-batches are joined for decoding). ``fixed``: bytes held once whatever the batch (state
  leaves without a batch axis: CriticalKV's W^O). ``parts``: the named terms, for the record.
  """

  kept: int
  transient: int
  split: bool = False
  fixed: int = 0
  parts: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """A decode ``batch`` and a ``prefill_batch`` (its sub-batches), with what they rest on.

  ``source``: ``"plan"`` (from memory) or ``"override"`` (``--config.batch_size``);
  ``need_bytes``: the device bytes the plan expects at its peak (weights, other, caches,
  transients, margin); ``device_bytes``: what the device has.
  """

  batch: int
  prefill_batch: int
  source: str
  need_bytes: int
  device_bytes: int
  weights_bytes: int
  sample: SampleBytes

  def record(self) -> dict:
    """The fields an accuracy record carries."""
    return dict(plan_batch=self.batch, plan_prefill_batch=self.prefill_batch,
                plan_source=self.source, plan_bytes=self.need_bytes,
                plan_device_bytes=self.device_bytes, plan_kept_bytes=self.sample.kept,
                plan_transient_bytes=self.sample.transient)

  def halved(self) -> "BatchPlan":
    """The plan with half the batch (after the device ran out of memory anyway)."""
    b = max(1, self.batch // 2)
    return dataclasses.replace(self, batch=b, prefill_batch=min(self.prefill_batch, b),
                               source=self.source + "/halved")


def need(sample: SampleBytes, batch: int, prefill_batch: int, *, weights_bytes: int,
         other_bytes: int, margin_bytes: int) -> int:
  """Device bytes at the peak of a batch (the module docstring's inequality, left side)."""
  return (weights_bytes + other_bytes + sample.fixed + batch * sample.kept
          + prefill_batch * sample.transient + margin_bytes)


def margin(device_bytes: int, fraction: float) -> int:
  """The safety margin: ``fraction`` of the device plus ``FIXED_MARGIN``."""
  return int(fraction * device_bytes) + FIXED_MARGIN


def choose(sample: SampleBytes, *, device_bytes: int, weights_bytes: int, max_batch: int,
           other_bytes: int = 0, margin_fraction: float = 0.1, override: int = 0,
           prefill_override: int = 0) -> BatchPlan:
  """The largest batch (at most ``max_batch``) of ``sample``s that fits, and its prefill batch.

  Args:
    sample: the method's bytes per sample (``sample_bytes``).
    device_bytes: the device's memory (``bytes_limit``).
    weights_bytes: the model's parameters.
    max_batch: the samples there are to run (a larger batch would only pad).
    other_bytes: anything else already on the device.
    margin_fraction: of ``device_bytes``, kept free on top of 1 GiB.
    override: a batch size to use whatever the plan says (0: plan).
    prefill_override: a prefill sub-batch to use (0: plan; only methods that split).

  Raises:
    DoesNotFit: one sample does not fit (and no override asks for it anyway).
  """
  fixed = dict(weights_bytes=weights_bytes, other_bytes=other_bytes,
               margin_bytes=margin(device_bytes, margin_fraction))
  room = device_bytes - need(sample, 0, 0, **fixed)
  if override:
    batch = int(override)
    pre = batch if not sample.split else (prefill_override or _prefill_for(sample, batch, room))
    pre = max(1, min(pre, batch))
    return BatchPlan(batch, pre, "override", need(sample, batch, pre, **fixed), device_bytes,
                     weights_bytes, sample)
  per = sample.kept + (0 if sample.split else sample.transient)
  first = sample.transient if sample.split else 0  # one sample's prefill at a time
  if room - first < per:
    raise DoesNotFit(
        f"not even one sample fits: {_gib(sample.kept)} kept + {_gib(sample.transient)} while "
        f"prefilled per sample, {_gib(weights_bytes)} weights, {_gib(other_bytes)} other and "
        f"{_gib(fixed['margin_bytes'])} margin against {_gib(device_bytes)} of device memory; "
        "use a shorter length, a smaller model or a device with more memory "
        "(or force --config.batch_size=1)")
  batch = max(1, min(int(max_batch), (room - first) // per))
  pre = batch
  if sample.split:
    pre = prefill_override or _prefill_for(sample, batch, room)
    pre = max(1, min(pre, batch))
  return BatchPlan(batch, pre, "plan", need(sample, batch, pre, **fixed), device_bytes,
                   weights_bytes, sample)


def _prefill_for(sample: SampleBytes, batch: int, room: int) -> int:
  """The largest prefill sub-batch next to ``batch`` compacted samples (at least 1)."""
  left = room - batch * sample.kept
  return max(1, min(batch, left // max(sample.transient, 1)))


def _gib(n: int) -> str:
  return f"{n / GIB:.2f} GiB"


# ---- bytes of a method's sample, from the code's own layouts (nothing allocated) ----


def tree_bytes(tree) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def splits_prefill(method) -> bool:
  """Whether ``method`` prefills in sub-batches: a compression method (its compacted caches
  are joined along the batch for decoding, sized by the static ``decode_slots``)."""
  from sparse_attn.compression import base  # pylint: disable=g-import-not-at-top
  return isinstance(method, base.CompressionMethod) and method.compresses_prefill


def with_decode_slots(method, capacity: int, longest_prompt: int):
  """A compression method with ``decode_slots = capacity - longest_prompt`` (its compacted
  cache then has one static size for any batch of prompts up to ``longest_prompt``); any
  other method unchanged."""
  if not splits_prefill(method):
    return method
  return dataclasses.replace(method, decode_slots=int(capacity - longest_prompt))


def sample_bytes(model_config, method, *, capacity: int, longest_prompt: int,
                 prefill_chunk: int) -> SampleBytes:
  """Bytes per sample of ``method`` at ``capacity`` slots (see the module docstring).

  Args:
    model_config: the model's ``ModelConfig``.
    method: the attention method (a compression method is sized with ``with_decode_slots``).
    capacity: cache slots per sample (prompt + answer, rounded up).
    longest_prompt: the longest prompt (tokens) of the run at this capacity.
    prefill_chunk: prompt tokens per prefill step.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from models import llama, steps  # pylint: disable=g-import-not-at-top
  cfg = model_config.for_context(capacity)
  dt = llama.compute_dtype(cfg)
  item = jnp.dtype(dt).itemsize
  full = tree_bytes(jax.eval_shape(lambda: steps.init_caches(cfg, method, 1, capacity)))
  fixed = per_layer_state_bytes(cfg, method, capacity) - full if hasattr(
      method, "layer_state") else 0
  c = min(int(prefill_chunk), capacity)
  e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  n, k = cfg.num_heads, cfg.num_kv_heads
  acts = c * (3 * e + (n + 2 * k) * d + n * d + 3 * f) * item
  tile = n * min(c, 128) * min(capacity, 256) * 4 * 3  # one f32 attention tile (logits, probs)
  head = e * 4 + cfg.vocab_size * 4
  parts = dict(cache_and_state=full, chunk_activations=acts + tile + head, per_layer=fixed)
  if not splits_prefill(method):
    return SampleBytes(kept=full, transient=acts + tile + head, split=False, fixed=fixed,
                       parts=parts)
  m = with_decode_slots(method, capacity, longest_prompt)
  compact = tree_bytes(jax.eval_shape(lambda: steps.end_prefill(
      *steps.init_caches(cfg, m, 1, capacity), config=cfg, method=m)))
  window = int(getattr(m, "window_size", OBSERVATION_WINDOW) or OBSERVATION_WINDOW)
  scoring = 2 * n * window * capacity * 4 + k * capacity * d * 4
  parts.update(compacted=compact, scoring_scratch=scoring)
  return SampleBytes(kept=compact, transient=full + acts + tile + head + scoring, split=True,
                     fixed=fixed, parts=parts)


def per_layer_state_bytes(cfg, method, capacity: int) -> int:
  """Bytes of one sample's caches and states with everything a run's ``layer_state`` adds
  (``steps.init_caches`` given weights of ``cfg``'s shapes: W^O included)."""
  import jax  # pylint: disable=g-import-not-at-top
  from models import llama, steps  # pylint: disable=g-import-not-at-top
  params = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.key(0)))
  return tree_bytes(jax.eval_shape(
      lambda p: steps.init_caches(cfg, method, 1, capacity, p), params))


# ---- the device ----


def device_memory() -> tuple[int, int]:
  """``(device bytes, bytes in use now)``: the accelerator's ``bytes_limit`` and
  ``bytes_in_use``; on a backend without memory stats (a CPU), the host memory available now
  and 0."""
  import jax  # pylint: disable=g-import-not-at-top
  from experiments.common import heap  # pylint: disable=g-import-not-at-top
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
  return int(heap.available_bytes()), 0


def peak_bytes() -> int | None:
  """The device's peak bytes in use so far in this process (None where not reported)."""
  import jax  # pylint: disable=g-import-not-at-top
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else int(peak)


def combined(samples) -> SampleBytes:
  """One sample of several methods run side by side (teacher forcing in lockstep): their caches
  and states all kept, prefilled one method at a time (the largest transient), in sub-batches
  only if every method splits."""
  samples = list(samples)
  if len(samples) == 1:
    return samples[0]
  return SampleBytes(kept=sum(s.kept for s in samples),
                     transient=max(s.transient for s in samples),
                     split=all(s.split for s in samples), fixed=sum(s.fixed for s in samples),
                     parts=dict(methods=[s.parts for s in samples]))


def plan(model, method, *, capacity: int, longest_prompt: int, prefill_chunk: int,
         max_batch: int, margin_fraction: float = 0.1, override: int = 0,
         prefill_override: int = 0) -> BatchPlan:
  """``choose`` for ``method`` (or a list of methods side by side, ``combined``) on this
  process's device with ``model`` already loaded.

  The weights are counted from ``model.params``; whatever else is in use on the device
  (``bytes_in_use`` beyond them) is ``other``. On a CPU the device bytes are the host memory
  available now plus the weights (already loaded).
  """
  sample = combined(sample_bytes(model.config, m, capacity=m.round_capacity(capacity),
                                 longest_prompt=longest_prompt, prefill_chunk=prefill_chunk)
                    for m in (method if isinstance(method, (list, tuple)) else [method]))
  weights = tree_bytes(model.params)
  total, in_use = device_memory()
  if in_use == 0:  # host memory: ``total`` is what is left after the weights were loaded
    total += weights
  other = max(0, in_use - weights)
  return choose(sample, device_bytes=total, weights_bytes=weights, other_bytes=other,
                max_batch=max_batch, margin_fraction=margin_fraction, override=override,
                prefill_override=prefill_override)
