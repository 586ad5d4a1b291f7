"""RocketKV's hybrid sparse attention (Behnam et al., ICML 2025, arXiv 2502.14051, Sec. 4.2).

Stage 2 of RocketKV (stage 1, SnapKV++ eviction, is ``compression.rocketkv``): the top-k
tokens of each kv group are chosen from approximate attention scores that read keys reduced
in both the sequence and the head dimension, then attended exactly. Per kv head, with the
group's queries ``Q [G, D]`` and keys ``K [T, D]`` (the authors' code,
``pipeline/inf_stream_llm/inf_llm/attention/rocket.py`` lines 212-266, commit of github
NVlabs/RocketKV):

1. sign-aware sequence reduction: ``s = sign(sum_g Q_g)`` (+1 where the sum is > 0, else -1);
   the keys ``s * K`` are cut into chunks of ``cs = ceil(sqrt(c))`` consecutive tokens
   (``cs = 1`` when that exceeds ``c``) and each chunk keeps its element-wise max, an upper
   bound of ``(s * q) . k`` for every query whose signs agree with ``s``;
2. head-dimension reduction: the ``r = int(D * cs / c)`` dimensions where the group's mean
   ``|Q|`` is largest (SparQ's rule); ``QK_hat = (s * Q)[:, i] . chunkmax[:, i]``, every token
   taking its chunk's score;
3. ``s_hat = softmax(QK_hat / sqrt(D * sum_i |Q_i| / sum |Q|))`` over the context (SparQ's
   temperature), averaged over the group's ``G`` heads; the ``k`` best tokens are chosen
   (one list per kv head) and attended with the exact keys and values (the sparse kernel).

``c`` is the stage's compression ratio, the factor by which the reduced keys are smaller than
the keys (``T/cs * r = T D / c`` elements): RocketKV sets ``c = capacity / token_budget``
(``pipeline/inf_stream_llm/infllm_utils.py`` line 156). The authors force no sinks or local
window (the budget defaults ``n_sink=0, local_window=0`` here, as TidalDecode's). With
``c = 1`` the estimate reads whole keys (``cs = 1``, ``r = D``): the ranking is the group's
mean of softmax weights of the exact (sign-flipped) logits, which for ``G = 1`` is the exact
top-k. The chunks here follow cache slots (which after eviction are the kept tokens in order,
as the authors' gathered cache is).

Letters: B batch, K kv heads, G group, T slots, C chunks, D head dim, R kept dims.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels import Impl
from sparse_attn import placement, selection
from sparse_attn.selectors.base import Selector


def reduction(c: float, head_dim: int) -> tuple[int, int]:
  """``(cs, r)``: the chunk size and the head dimensions kept at compression ratio ``c``."""
  cs = math.ceil(math.sqrt(c))
  cs = cs if cs <= c else 1
  return cs, max(1, min(head_dim, int(head_dim * cs / c)))


def approximate_scores(q, k, valid, c: float):
  """RocketKV's estimated attention ``[B, K, T]`` (group mean; 0 off ``valid``).

  Args:
    q: ``[B, K, G, D]`` the group's queries; k: ``[B, K, T, D]``; valid: ``[B, K, T]`` bool.
    c: the compression ratio of the reduced keys (see the module docstring).
  """
  b, hkv, t, d = k.shape
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  cs, r = reduction(c, d)
  sign = jnp.where(jnp.sum(q, axis=2, keepdims=True) > 0, 1.0, -1.0)  # [B, K, 1, D]
  n_chunks = -(-t // cs)
  low = jnp.finfo(jnp.float32).min
  signed = jnp.where(valid[..., None], k * sign, low)  # empty slots never raise a chunk's max
  signed = jnp.pad(signed, ((0, 0), (0, 0), (0, n_chunks * cs - t), (0, 0)),
                   constant_values=low)
  chunk_max = jnp.max(signed.reshape(b, hkv, n_chunks, cs, d), axis=3)  # [B, K, C, D]
  absq = jnp.abs(q)
  _, dims = jax.lax.top_k(jnp.mean(absq, axis=2), r)  # [B, K, R]
  q_hat = jnp.take_along_axis(q * sign, dims[:, :, None, :], axis=-1)  # [B, K, G, R]
  k_hat = jnp.take_along_axis(chunk_max, dims[:, :, None, :], axis=-1)  # [B, K, C, R]
  qk = jnp.einsum("bkgr,bkcr->bkgc", q_hat, k_hat)
  qk = jnp.repeat(qk, cs, axis=-1)[..., :t]  # [B, K, G, T]: each token its chunk's score
  temp = jnp.sqrt(d * jnp.sum(jnp.abs(q_hat), -1) / jnp.maximum(jnp.sum(absq, -1), 1e-30))
  logits = jnp.where(valid[:, :, None], qk / temp[..., None], -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  e = jnp.where(valid[:, :, None], jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  w = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
  return jnp.mean(w, axis=2)


@dataclasses.dataclass(frozen=True)
class HybridSparse(Selector):
  """RocketKV's hybrid sparse attention top-k (see the module docstring).

  Attributes (besides ``budget``, the ``k`` tokens, and ``block_size``):
    c: the compression ratio of the approximate keys (>= 1; 1 reads whole keys).
  """

  c: float = 8.0

  name: ClassVar[str] = "hybrid"
  token_level: ClassVar[bool] = True
  budget_defaults: ClassVar[dict] = dict(n_sink=0, local_window=0)

  def __post_init__(self):
    from sparse_attn.budget import Budget  # pylint: disable=g-import-not-at-top
    if self.budget is not None and not isinstance(self.budget, Budget):
      object.__setattr__(self, "budget", Budget(budget=self.budget, **self.budget_defaults))
    object.__setattr__(self, "gqa", "group")  # one list per kv head (the group's mean)
    super().__post_init__()
    if isinstance(self.c, bool) or not isinstance(self.c, (int, float)) or self.c < 1:
      raise ValueError(f"c must be a number >= 1, got {self.c!r}")
    object.__setattr__(self, "c", float(self.c))

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """The ``k`` best slots per kv head by the approximate scores of ``q [B, Hq, D]``."""
    del scale, impl, interpret, windowed, place  # the estimate has its own temperature
    b, hq, d = q.shape
    hkv = cache.num_kv_heads
    valid = cache.valid & (jnp.arange(cache.capacity)[None, None, :] < cache.length[:, None, None])
    est = approximate_scores(q.reshape(b, hkv, hq // hkv, d), cache.k, valid, self.c)
    forced = self.budget.forced(cache.length, cache.capacity, 1)[:, None, :] & valid
    n_max = min(self.budget.max_count(cache.capacity, 1), cache.capacity)
    count = self.budget.total(cache.length, jnp.sum(forced[:, 0], -1).astype(jnp.int32), 1)
    _, idx = jax.lax.top_k(jnp.where(forced, 2.0, jnp.where(valid, est, -1.0)), n_max)
    n = jnp.maximum(count[:, None], jnp.sum(forced, -1))  # per kv head: heads keep unlike counts
    n = jnp.minimum(jnp.minimum(n, jnp.sum(valid, -1)), n_max)
    return selection.Selection(idx=idx.astype(jnp.int32), n_valid=n.astype(jnp.int32),
                               granularity=1)
