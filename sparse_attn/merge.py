"""Exact combination of partial attention results (the flash-decoding combine).

If ``(o1, l1)`` attends key set A and ``(o2, l2)`` a disjoint set B, ``merge`` returns exactly
the ``(out, lse)`` of attending A u B: ``lse = log(e^l1 + e^l2)`` and
``out = (e^l1 o1 + e^l2 o2) / e^lse``. Empty parts (``lse = -inf``) contribute nothing.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.softmax import lse_combine


def merge(a, b):
  """Merges two partial results ``(out [..., D], lse [...])``; returns ``(out, lse)``."""
  (o1, l1), (o2, l2) = a, b
  return merge_n(jnp.stack([o1.astype(jnp.float32), o2.astype(jnp.float32)]),
                 jnp.stack([l1, l2]), out_dtype=o1.dtype)


def merge_n(outs, lses, axis: int = 0, out_dtype=None):
  """n-way merge of partials stacked along ``axis``.

  Args:
    outs: ``[..., n, ..., D]`` partial outputs (``axis`` indexes the parts).
    lses: the matching ``[..., n, ...]`` log-sum-exps (float32, ``-inf`` for empty parts).
    axis: the parts axis (of ``lses``; the same axis in ``outs``).
    out_dtype: dtype of the merged output (default ``outs.dtype``).

  Returns:
    ``(out, lse)`` with the parts axis removed; ``out = 0, lse = -inf`` when all parts are empty.
  """
  out_dtype = outs.dtype if out_dtype is None else out_dtype
  out, lse = lse_combine(outs, lses, axis)
  return out.astype(out_dtype), lse
