"""Block (page) scores from the cache digests: Quest and ArkVale.

Letters: B batch, K kv heads, H scoring heads (K for group-shared selection, Hq per head),
NB blocks, D head dim. Scores are float32 and unscaled (``q . k`` units).
"""

from __future__ import annotations

import jax.numpy as jnp

GQA_MODES = ("head", "group")


def scoring_queries(q, num_kv_heads: int, gqa: str):
  """Queries that score blocks: ``q [B, Hq, D]`` -> ``[B, H, D]``.

  ``gqa="head"``: every query head scores for itself (H = Hq). ``gqa="group"``: ReSA's group
  sharing, the mean-pooled query of the G heads of a kv head scores once (H = K; Sun et al.
  2025, Sec. 2.1 and Fig. 3).
  """
  if gqa == "head":
    return q
  if gqa == "group":
    b, hq, d = q.shape
    return jnp.mean(q.astype(jnp.float32).reshape(b, num_kv_heads, hq // num_kv_heads, d),
                    axis=2).astype(q.dtype)
  raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")


def _per_kv_head(qs, num_kv_heads):
  b, h, d = qs.shape
  return qs.astype(jnp.float32).reshape(b, num_kv_heads, h // num_kv_heads, d)


def quest_scores(qs, kmin, kmax):
  """Quest's upper bound of ``q . k`` over a block (Tang et al. 2024, Sec. 3.2, Eq. 1).

  ``score = sum_d max(q_d * kmax_d, q_d * kmin_d)``. Since the digests satisfy
  ``kmin <= kmax``, the max picks ``kmax_d`` where ``q_d > 0`` and ``kmin_d`` elsewhere:
  ``score = relu(q) . kmax + min(q, 0) . kmin``, two matmuls straight on the digests.

  Args:
    qs: ``[B, H, D]`` scoring queries (H a multiple of K).
    kmin, kmax: ``[B, K, NB, D]`` block digests.

  Returns:
    ``[B, H, NB]`` float32.
  """
  qg = _per_kv_head(qs, kmin.shape[1])  # [B, K, r, D]
  f32 = dict(preferred_element_type=jnp.float32)
  # [B, K, r, NB]
  s = (jnp.einsum("bkrd,bknd->bkrn", jnp.maximum(qg, 0.0), kmax.astype(jnp.float32), **f32)
       + jnp.einsum("bkrd,bknd->bkrn", jnp.minimum(qg, 0.0), kmin.astype(jnp.float32), **f32))
  return s.reshape(qs.shape[0], qs.shape[1], -1)


ARKVALE_VARIANTS = ("sphere", "cuboid")


def arkvale_scores(qs, kcen, krad, kmin, kmax, variant: str = "sphere"):
  """ArkVale page-importance estimates from bounding volumes (Chen et al. 2024, Sec. 4.2).

  ``sphere``: the page's keys lie in a ball (centroid ``c``, radius ``r``), so
  ``max_j q . k_j <= q . c + ||q|| r``. ``cuboid``: the keys lie in the box ``[kmin, kmax]`` and
  the bound is the box maximum ``sum_d max(q_d kmax_d, q_d kmin_d)`` (the same bound as Quest).

  Args:
    qs: ``[B, H, D]``; kcen, kmin, kmax: ``[B, K, NB, D]``; krad: ``[B, K, NB]``.

  Returns:
    ``[B, H, NB]`` float32.
  """
  if variant == "cuboid":
    return quest_scores(qs, kmin, kmax)
  if variant != "sphere":
    raise ValueError(f"ArkVale variant must be one of {ARKVALE_VARIANTS}, got {variant!r}")
  qg = _per_kv_head(qs, kcen.shape[1])
  qn = jnp.linalg.norm(qg, axis=-1)  # [B, K, r]
  s = (jnp.einsum("bkrd,bknd->bkrn", qg, kcen.astype(jnp.float32))
       + qn[..., None] * krad[:, :, None, :])
  return s.reshape(qs.shape[0], qs.shape[1], -1)
