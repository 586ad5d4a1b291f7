"""ShadowKV's sparse selection (Sun et al., 2024, arXiv 2410.21465, Sec. 4), GPU-resident.

ShadowKV keeps, after the prompt, a low-rank copy of the pre-RoPE keys and one *landmark* per
chunk of ``c`` tokens, and at each decode step attends a few chunks chosen by their landmarks.
Per layer and kv head, with post-RoPE keys ``k_j`` (read from the authors' code, github
bytedance/ShadowKV at a21f5a9, ``ShadowKVCache`` in its kv_cache module):

* landmarks: ``L_i = mean_{j in chunk i} k_j`` (``prefill_kv_cache``): the ``"sphere"``
  digest's ``kcen`` (the mean of a block's valid keys) with chunk = cache block;
* outliers: the ``n_out`` chunks with the least ``min_{j in i} cos(k_j, L_i)`` (the
  ``"cosine"`` digest ``kcos``), per kv head, are kept exactly and always attended; they and
  the local chunks have no landmark to score;
* scores (``get_retrieval_position_ids``): per query head ``h`` of kv head ``k``,
  ``p_h = softmax_i(q_h . L_i / sqrt(D))`` over the remaining chunks, then the group's max
  ``s_i = max_{h in group} p_{h,i}``; the ``budget`` best chunks per kv head are chosen (one
  list per kv head, shared by its group);
* the chosen chunks' keys are rebuilt from the low-rank store and re-rotated
  (``get_key_cache``): ``K_pre ~ U_r (S_r V_r^T)`` over ``[T, K * D]`` (all kv heads of the
  layer in one SVD, ``get_svd``), ``k_j = RoPE(K_pre[j], pos_j)``; attention is exact over
  the rebuilt keys and the exact values.

Defaults from the code: chunk size 8, ``outliers=48`` chunks, 4 local chunks (the prompt's
last 32 to 39 tokens plus every generated token), no sinks, ``rank=160`` (8B models:
``K * D = 1024``), sparse budget 2048 tokens (1.56% of 128k), every layer sparse.

Fit to this library, and what differs:

* chunks are cache blocks: ``block_size`` (16 by default: the Pallas kernels need a power of 2
  >= 16; ``block_size=8`` is the paper's chunk on the jnp path, ``impl="xla"``);
* the forced entries are the library's ``Budget``: ``budget_defaults`` gives no sinks and a
  32-token local window (the paper's 4 chunks); tokens generated more than 32 steps ago are
  selectable blocks with landmarks here, not always attended;
* landmarks, outlier statistics and the budget follow the cache as it grows (every block's
  digest is refreshed on write), not only the prompt's chunks; the budget is the selected
  tokens, with the local window and the outliers on top (``forced_count="extra"``);
  ``attended_tokens`` (``ShadowKV.accounting``) counts the outlier blocks with the sinks and
  local window as ``forced`` (also given alone as ``outliers``), the landmark choice as ``chosen``;
* the score softmax uses ``1/sqrt(D)`` (the code writes ``1/sqrt(128)``, the same at D = 128);
* ``rank=None`` (the default) attends the *exact* keys of the chosen blocks: ShadowKV's
  selection alone. ``rank=r`` is the paper's numerics (``ShadowKVMethod.end_prefill``: the
  prompt's keys outside the outlier and local blocks are replaced by their rank-``r``
  reconstruction, rebuilt once rather than per step, in float32 through the eigenvectors of
  ``K_pre^T K_pre``, the same projection as the SVD); the digests stay the exact keys' (the
  paper's landmarks). It needs the model's RoPE (``with_rope``). It simulates the arithmetic,
  not the storage: the full key buffer stays allocated. The value offload to the CPU is out of
  scope: values stay on the device.

Letters: B batch, K kv heads, G group, H scoring heads (Hq, or K with ``gqa="group"``), NB
blocks, T slots, D head dim, R rank.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import Impl
from sparse_attn import placement, scoring, selection, sliding_window
from sparse_attn.budget import Budget
from sparse_attn.compression import rope
from sparse_attn.selectors.base import BlockSelector


def landmark_scores(qs, kcen, cand):
  """ShadowKV's chunk scores ``[B, K, NB]``: each scoring head's softmax of
  ``q . L / sqrt(D)`` over the candidate blocks ``cand [B, K, NB]``, max over the heads of a
  group (``qs [B, H, D]``, ``kcen [B, K, NB, D]``); 0 off ``cand``."""
  b, h, d = qs.shape
  hkv = kcen.shape[1]
  qg = qs.astype(jnp.float32).reshape(b, hkv, h // hkv, d)
  logits = jnp.einsum("bkgd,bknd->bkgn", qg, kcen.astype(jnp.float32), **scoring.EXACT)
  logits = jnp.where(cand[:, :, None], logits / jnp.sqrt(jnp.float32(d)), -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))  # exp(-inf) = 0 off cand
  p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
  return jnp.max(p, axis=2)


@dataclasses.dataclass(frozen=True)
class ShadowKV(BlockSelector):
  """ShadowKV's landmark selection with forced outlier blocks (see the module docstring).

  Attributes (besides ``budget``, ``block_size``):
    gqa: ``"head"`` (ShadowKV: each query head's softmax, max over the group) or ``"group"``
      (the group's mean query scores). Either way one list per kv head.
    outliers: outlier blocks per kv head, always attended on top of the budget (48: the
      authors' count for 128K prompts).
    outlier_share: None, or the outliers as a share of the context's blocks, which replaces
      ``outliers``: ``ceil(share * blocks)`` per kv head (float32 arithmetic). The paper's
      0.3% ("outliers account for ~0.3% of chunks"; 48 of the 16,384 8-token chunks of 128K)
      is ``0.003``: at 4K that is 1 block where 48 would be 19% of the context.
    rank: None to attend exact keys, or the rank of the paper's low-rank pre-RoPE keys
      (``K * D`` or more: exact).
  """

  outliers: int = 48
  outlier_share: float | None = None
  rank: int | None = None

  name: ClassVar[str] = "shadowkv"
  budget_defaults: ClassVar[dict] = dict(n_sink=0, local_window=32)

  def __post_init__(self):
    if self.budget is not None and not isinstance(self.budget, Budget):
      object.__setattr__(self, "budget", Budget(budget=self.budget, **self.budget_defaults))
    super().__post_init__()
    if self.topp is not None or self.adakv is not None:
      raise ValueError("shadowkv has its own budget rule (outliers + top-k): no topp / adakv")
    for field, low in (("outliers", 0), ("rank", 1)):
      val = getattr(self, field)
      if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < low):
        raise ValueError(f"{field} must be an int >= {low}, got {val!r}")
    share = self.outlier_share
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                              or not 0.0 < share <= 1.0):
      raise ValueError(f"outlier_share must be a number in (0, 1], got {share!r}")

  def outlier_blocks(self, n_blocks):
    """Outlier blocks per kv head of a context of ``n_blocks`` blocks (a host int, or an int
    array): ``outliers``, or ``ceil(outlier_share * n_blocks)``; at most ``n_blocks``."""
    xp = np if isinstance(n_blocks, (int, np.integer)) else jnp
    if self.outlier_share is None:
      return xp.minimum(self.outliers, n_blocks)
    n = xp.ceil(xp.float32(self.outlier_share) * xp.asarray(n_blocks, xp.float32))
    return xp.minimum(n.astype(xp.int32), n_blocks)

  @property
  def digests(self) -> tuple[str, ...]:
    return ("sphere", "cosine")

  @property
  def group_shared(self) -> bool:
    return True  # one list per kv head whatever scores it (the code's max over the group)

  @property
  def context_parallel(self) -> bool:
    return False  # the softmax and the outlier ranking span every block

  @property
  def method_class(self):
    """``ShadowKVMethod`` (it rebuilds the keys at ``end_prefill``) with a ``rank``."""
    if self.rank is None:
      from sparse_attn.method import Method  # pylint: disable=g-import-not-at-top
      return Method
    from sparse_attn.shadowkv import ShadowKVMethod  # pylint: disable=g-import-not-at-top
    return ShadowKVMethod

  def masks(self, cache, windowed: bool = False):
    """``(valid [B, NB], forced [B, NB], outlier [B, K, NB], cand [B, K, NB])``: blocks in the
    context, the local window / sinks, the outliers and the blocks scored by landmark."""
    nb, bs = cache.num_blocks, cache.block_size
    valid = jnp.arange(nb)[None, :] * bs < cache.length[:, None]
    forced = self.budget.forced(cache.length, nb, bs) & valid
    free = jnp.broadcast_to((valid & ~forced)[:, None], cache.kcos.shape)
    if windowed:  # blocks with no visible key are neither outliers nor candidates
      free &= jnp.isfinite(sliding_window.mask_block_scores(jnp.zeros(free.shape), cache))
    n_out = int(self.outlier_blocks(nb))  # the most any row has (static)
    low, ids = jax.lax.top_k(jnp.where(free, -cache.kcos, -jnp.inf), n_out)
    outlier = jnp.zeros(free.shape, bool)
    if n_out:
      want = self.outlier_blocks(jnp.sum(valid, axis=-1, dtype=jnp.int32))  # [B]
      take = jnp.isfinite(low) & (jnp.arange(n_out) < want[:, None, None])
      b, k = jnp.indices(ids.shape[:2])
      outlier = outlier.at[b[..., None], k[..., None], ids].max(take)
    return valid, forced, outlier, free & ~outlier

  def accounting(self, context: int) -> dict:
    """Tokens one decode step attends per kv head at ``context`` tokens (host ints), as
    ``select`` counts them: the budget's forced blocks (sinks, local window), then
    ``min(outlier_blocks(blocks), free blocks)`` outlier blocks out of the rest, then the
    budget's blocks by landmark score out of what is left, at most every block. ``forced``
    holds the sinks, local window and outliers (attended whatever the query; ``outliers`` is
    their outlier part), ``chosen`` the landmark choice, ``total = forced + chosen``; blocks
    are disjoint, and a partial last block that is not forced counts as the largest (an upper
    bound)."""
    context, bs = int(context), self.block_size
    if context <= 0:
      return dict(forced=0, chosen=0, total=0, context=context, outliers=0)
    m = -(-context // bs)
    ln = np.array([context], np.int32)
    forced = np.asarray(self.budget.forced(ln, m, bs))[0]
    tokens = np.minimum(bs, context - np.arange(m) * bs)  # tokens per block
    n_forced = int(forced.sum())
    free = np.sort(tokens[~forced])[::-1]
    n_out = min(int(self.outlier_blocks(m)), free.size)
    total = min(m, int(np.asarray(self.budget.total(ln, np.array([n_forced]), bs))[0]) + n_out)
    out_tok = int(free[:n_out].sum())
    f_tok = int(tokens[forced].sum()) + out_tok
    c_tok = int(free[n_out:total - n_forced].sum())
    return dict(forced=f_tok, chosen=c_tok, total=f_tok + c_tok, context=context,
                outliers=out_tok)

  def block_scores(self, qs, cache, *, impl: Impl = "auto", interpret: bool = False):
    """``landmark_scores`` of ``qs [B, H, D]`` over the candidate blocks -> ``[B, K, NB]``."""
    del impl, interpret  # no kernel: one [G, NB] product per kv head
    return landmark_scores(qs, cache.kcen, self.masks(cache)[3])

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """Local blocks, then the outliers, then the ``budget`` best landmark scores per kv head."""
    del scale, place  # the score softmax has its own 1/sqrt(D); one device
    missing = [k for k in self.digests if not cache.has_digests(k)]
    if missing:
      raise ValueError(f"shadowkv reads the {missing} block digests, which this cache does not "
                       "keep: make it with the method's init_cache")
    valid, forced, outlier, cand = self.masks(cache, windowed)
    qs = scoring.scoring_queries(q, cache.num_kv_heads, self.gqa)
    s = landmark_scores(qs, cache.kcen, cand)  # in [0, 1]
    rank = jnp.where(outlier, 2.0, jnp.where(cand, s, -1.0))
    bs, nb = cache.block_size, cache.num_blocks
    n_out = jnp.sum(outlier, axis=-1).max(axis=-1)  # [B] (equal over heads but when windowed)
    count = self.budget.total(cache.length, jnp.sum(forced, -1).astype(jnp.int32), bs) + n_out
    n_max = min(nb, self.budget.max_count(cache.capacity, bs) + int(self.outlier_blocks(nb)))
    return selection.top_entries(rank, valid, forced, count.astype(jnp.int32), n_max, bs)

  def low_rank_keys(self, cache, inv_freq):
    """``cache`` whose prompt keys outside the outlier and local blocks are their rank-``rank``
    reconstruction (pre-RoPE, all kv heads in one ``[T, K * D]`` matrix), re-rotated; the
    digests are left as the exact keys' (the landmarks). ``inv_freq [D/2]``: the model's RoPE."""
    b, hkv, t, d = cache.k.shape
    ok = cache.valid
    pre = rope.rotate_by(cache.k.astype(jnp.float32), -jnp.maximum(cache.pos, 0), inv_freq)
    x = jnp.where(ok[..., None], pre, 0.0).transpose(0, 2, 1, 3).reshape(b, t, hkv * d)
    gram = jnp.einsum("btm,btn->bmn", x, x, **scoring.EXACT)
    _, vecs = jnp.linalg.eigh(gram)  # ascending eigenvalues
    v = vecs[..., -min(self.rank, hkv * d):]  # [B, KD, R]: the top right singular vectors
    rec = jnp.einsum("btr,bmr->btm", jnp.einsum("btm,bmr->btr", x, v, **scoring.EXACT), v,
                     **scoring.EXACT)
    rec = rec.reshape(b, t, hkv, d).transpose(0, 2, 1, 3)
    rec = rope.rotate_by(rec, jnp.maximum(cache.pos, 0), inv_freq)
    _, forced, outlier, _ = self.masks(cache)
    exact = jnp.repeat(forced[:, None] | outlier, cache.block_size, axis=-1)
    return dataclasses.replace(cache, k=jnp.where((ok & ~exact)[..., None],
                                                  rec.astype(cache.k.dtype), cache.k))

