"""Block (page) scores from the cache digests: Quest and ArkVale, and the GQA sharing rule.

Letters: B batch, K kv heads, H scoring heads (K for group-shared selection, Hq per head),
G query heads per kv head, NB blocks, D head dim. Scores are float32 and unscaled (``q . k``
units).

Quest's bound is ``pallas_kernels.block_score`` (``kernels.quest_scores``), whose reference is
its jnp path. ArkVale's digests have no kernel; their dots run at ``HIGHEST`` precision like
Quest's: on a GPU XLA's default for float32 is TF32 (10-bit inputs), whose rounding reorders
near-tied blocks at the selection boundary.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp

from pallas_kernels import block_score_reference

# How a kv head's G query heads select: each for itself, or once with their mean (ReSA).
GQA = Literal["head", "group"]
GQA_MODES: tuple[str, ...] = get_args(GQA)
# float32 products and sums, never TF32 (see the module docstring)
EXACT = dict(preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def check_gqa(gqa) -> GQA:
  """``gqa`` itself, or a ValueError naming ``GQA_MODES``."""
  if gqa not in GQA_MODES:
    raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")
  return gqa


def pool_group(x, num_kv_heads: int, gqa: GQA):
  """Per-head rows ``x [B, Hq, ...]`` as the selection heads see them -> ``[B, H, ...]``.

  ``gqa="head"``: as given (H = Hq). ``gqa="group"``: ReSA's group sharing, the float32 mean
  over the G query heads of each kv head (H = K; Sun et al. 2025, Sec. 2.1 and Fig. 3), in
  ``x.dtype``.
  """
  if check_gqa(gqa) == "head":
    return x
  b, hq = x.shape[:2]
  g = hq // num_kv_heads
  return jnp.mean(x.astype(jnp.float32).reshape(b, num_kv_heads, g, *x.shape[2:]),
                  axis=2).astype(x.dtype)


def scoring_queries(q, num_kv_heads: int, gqa: GQA):
  """Queries that score blocks: ``q [B, Hq, D]`` -> ``[B, H, D]`` (``pool_group``)."""
  return pool_group(q, num_kv_heads, gqa)


def _per_kv_head(qs, num_kv_heads):
  b, h, d = qs.shape
  return qs.astype(jnp.float32).reshape(b, num_kv_heads, h // num_kv_heads, d)


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
    ``cuboid``: the bounding box itself (``r = max_j |c - k_j|``), Eq. 3 = Quest's bound
      (blocks past the context ``-inf``, as ``block_score``'s);
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
  qg = _per_kv_head(qs, cache.num_kv_heads)  # [B, K, r, D]
  if variant == "cuboid":  # the box's Eq. 3 is Quest's bound: the block_score reference
    s = block_score_reference(qg, cache.kmin, cache.kmax, cache.length,
                              block_size=cache.block_size)
    return s.reshape(qs.shape[0], qs.shape[1], -1)
  if variant == "cuboid-mean":
    centre = 0.5 * (cache.kmin.astype(jnp.float32) + cache.kmax.astype(jnp.float32))
    s = (jnp.einsum("bkrd,bknd->bkrn", qg, centre, **EXACT)
         + jnp.einsum("bkrd,bknd->bkrn", jnp.abs(qg), cache.kdev.astype(jnp.float32), **EXACT))
  else:
    s = (jnp.einsum("bkrd,bknd->bkrn", qg, cache.kcen.astype(jnp.float32), **EXACT)
         + jnp.linalg.norm(qg, axis=-1)[..., None] * cache.krad[:, :, None, :])
  return s.reshape(qs.shape[0], qs.shape[1], -1)
