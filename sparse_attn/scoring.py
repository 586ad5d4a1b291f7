"""Block (page) scores from the cache digests: Quest and ArkVale.

Letters: B batch, K kv heads, H scoring heads (K for group-shared selection, Hq per head),
NB blocks, D head dim. Scores are float32 and unscaled (``q . k`` units).

The dots run at ``HIGHEST`` precision: on a GPU XLA's default for float32 is TF32 (10-bit
inputs), whose rounding reorders near-tied blocks at the selection boundary, while the Pallas
``block_score`` kernel scores float32 exactly; both paths must pick the same blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GQA_MODES = ("head", "group")
# float32 products and sums, never TF32 (see the module docstring)
EXACT = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


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
  # [B, K, r, NB]
  s = (jnp.einsum("bkrd,bknd->bkrn", jnp.maximum(qg, 0.0), kmax.astype(jnp.float32), **EXACT)
       + jnp.einsum("bkrd,bknd->bkrn", jnp.minimum(qg, 0.0), kmin.astype(jnp.float32), **EXACT))
  return s.reshape(qs.shape[0], qs.shape[1], -1)


# ArkVale's page digests (Chen et al. 2024, Sec. 5.2): ``cuboid-mean`` (the default: the best
# estimator of their Fig. 7 and the one digest of the authors' released code), ``cuboid``
# (cuboid-max, the box of Eq. 3: Quest's bound) and ``sphere`` (sphere-max, Eq. 1).
ARKVALE_VARIANTS = ("cuboid-mean", "cuboid", "sphere")
ARKVALE_DIGESTS = {"cuboid-mean": ("box", "mean_box"), "cuboid": ("box",),
                   "sphere": ("box", "sphere")}


def arkvale_scores(qs, cache, variant: str = "cuboid-mean"):
  """ArkVale page-importance estimates from bounding volumes (Chen et al. 2024, Sec. 5.2).

  Every variant estimates ``max_j q . k_j`` over a page from its digest:
    ``cuboid-mean``: the box ``c +- r`` with ``c = (kmin + kmax) / 2`` the centre of the keys'
      bounding box and ``r = mean_j |c - k_j|`` per channel (Eq. 4), scored by Eq. 3:
      ``sum_d max(q_d (c_d + r_d), q_d (c_d - r_d)) = q . c + |q| . r``;
    ``cuboid``: the bounding box itself (``r = max_j |c - k_j|``), Eq. 3 = Quest's bound;
    ``sphere``: a ball of centre ``c`` (here the centroid) and radius ``max_j ||k_j - c||``,
      Eq. 1: ``q . c + ||q|| r``.

  Args:
    qs: ``[B, H, D]`` scoring queries (H a multiple of K).
    cache: a ``KVCache`` keeping ``ARKVALE_DIGESTS[variant]``.
    variant: one of ``ARKVALE_VARIANTS``.

  Returns:
    ``[B, H, NB]`` float32.
  """
  if variant not in ARKVALE_VARIANTS:
    raise ValueError(f"ArkVale variant must be one of {ARKVALE_VARIANTS}, got {variant!r}")
  if variant == "cuboid":
    return quest_scores(qs, cache.kmin, cache.kmax)
  qg = _per_kv_head(qs, cache.num_kv_heads)  # [B, K, r, D]
  if variant == "cuboid-mean":
    centre = 0.5 * (cache.kmin.astype(jnp.float32) + cache.kmax.astype(jnp.float32))
    s = (jnp.einsum("bkrd,bknd->bkrn", qg, centre, **EXACT)
         + jnp.einsum("bkrd,bknd->bkrn", jnp.abs(qg), cache.kdev.astype(jnp.float32), **EXACT))
  else:
    s = (jnp.einsum("bkrd,bknd->bkrn", qg, cache.kcen.astype(jnp.float32), **EXACT)
         + jnp.linalg.norm(qg, axis=-1)[..., None] * cache.krad[:, :, None, :])
  return s.reshape(qs.shape[0], qs.shape[1], -1)
