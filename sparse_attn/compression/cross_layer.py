"""One ranking over every layer: the prompt's budget shared by the layers, not split evenly.

Letters: B batch, L layers, K kv heads, T slots.

A per-layer method keeps ``K ceil((1 - ratio) n)`` of a layer's ``K n`` prompt entries. A method
that ranks the scores of *all* layers at once (KVzip's default: the authors' ``level="pair"``
threshold and kvpress's ``layerwise=False``) keeps the model's top ``ceil((1 - ratio) L K n)``
entries wherever they lie, so a layer whose scores are high keeps more than another. The
layers are compressed one at a time (``end_prefill``), so that ranking is turned into one
number per layer and row before them: how many of the model's top entries the layer holds
(``layer_totals``). Given that count, the layer's own top entries by the same order (forced
first, then score, ties by head and slot) are exactly the model-wide ranking's.

The hook: a method may define ``across_layers(caches, states, scale) -> states``, which
``models.steps.end_prefill`` (and the shared compression prefill's ``split``) call on the
per-layer lists after the prompt and before each layer's ``end_prefill`` (``apply``). KVzip
uses it for that ranking; ChunkKV's layer-wise index reuse to hand a layer's chunks to the
next ones (``chunkkv``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sparse_attn.compression.compact import rank_desc


def layer_totals(scores: Sequence[jax.Array], total) -> list[jax.Array]:
  """How many of the model's top ``total`` entries each layer holds.

  Args:
    scores: per layer ``[B, K, T]`` float32 slot scores (``+inf`` forced, ``-inf`` empty); the
      layers may differ in ``K`` and ``T``.
    total: ``[B]`` int entries kept over all layers.

  Returns:
    per layer ``[B]`` int32 counts, summing to ``min(total, valid entries)`` per row.
  """
  b = scores[0].shape[0]
  flat = jnp.concatenate([s.reshape(b, -1) for s in scores], axis=1)  # layer-major order
  kept = (rank_desc(flat) < jnp.asarray(total)[:, None]) & (flat > -jnp.inf)
  bounds = [0]
  for s in scores:
    bounds.append(bounds[-1] + s[0].size)
  return [jnp.sum(kept[:, lo:hi], axis=1, dtype=jnp.int32)
          for lo, hi in zip(bounds[:-1], bounds[1:])]


def apply(method, caches: list, states: list, scale=None) -> list:
  """``states`` (per-layer list) after ``method.across_layers``, if the method has one."""
  hook = getattr(method, "across_layers", None)
  if hook is None:
    return states
  return hook(caches, states, scale)
