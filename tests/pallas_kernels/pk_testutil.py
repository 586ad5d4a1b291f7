"""Shared case builders and checks of the pallas_kernels tests (imported by basename)."""

from __future__ import annotations

import dataclasses

import numpy as np
import jax.numpy as jnp
from hypothesis import strategies as st

# Tolerances keyed by dtype: (out atol, out rtol, lse atol). 16-bit outputs are rounded to their
# dtype and the kernel feeds 16-bit probabilities to the p.v matmul (as flash attention does);
# logits and lse are float32 in both paths, so lse stays tight.
TOLS = {
    jnp.float32: (2e-5, 2e-5, 2e-5),
    jnp.bfloat16: (2e-2, 2e-2, 1e-3),
    jnp.float16: (5e-3, 5e-3, 1e-3),
}
DTYPES = (jnp.float32, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Case:
  """A random sparse-decode problem; arrays are drawn fresh from ``seed``."""
  batch: int
  hkv: int
  group: int
  head_dim: int
  block_size: int
  num_blocks: int
  list_len: int
  per_head: bool
  dtype: object
  seed: int
  window: int = 1
  multi: bool = False  # multi-query layout: q [B, Hq, W, D]
  num_splits: int | None = None

  @property
  def hq(self):
    return self.hkv * self.group

  @property
  def sel_heads(self):
    return self.hq if self.per_head else self.hkv

  @property
  def t(self):
    return self.num_blocks * self.block_size

  def arrays(self):
    """q ``[B, Hq, D]`` (or ``[B, Hq, W, D]``), k, v, block_idx, n_valid, length, prior."""
    rng = np.random.default_rng(self.seed)
    b, hs, n, nb = self.batch, self.sel_heads, self.list_len, self.num_blocks
    qshape = (b, self.hq, self.head_dim) if not self.multi else (
        b, self.hq, self.window, self.head_dim)
    q = jnp.asarray(rng.standard_normal(qshape), self.dtype)
    k = jnp.asarray(rng.standard_normal((b, self.hkv, self.t, self.head_dim)), self.dtype)
    v = jnp.asarray(rng.standard_normal((b, self.hkv, self.t, self.head_dim)), self.dtype)
    # Distinct ids in random order; entries past n_valid hold junk (possibly out of range).
    idx = np.stack([[rng.permutation(nb)[:n] for _ in range(hs)] for _ in range(b)])
    n_valid = rng.integers(0, n + 1, (b, hs))
    n_valid[0, 0] = rng.choice([0, n])  # always exercise an empty and/or a full list
    for bi in range(b):
      for h in range(hs):
        idx[bi, h, n_valid[bi, h]:] = rng.integers(-5, nb + 5, n - n_valid[bi, h])
    # Lengths: 0, a partial last block, or the whole cache.
    length = rng.integers(0, self.t + 1, (b,))
    if b > 1:
      length[1] = rng.choice([0, self.t, max(self.t - self.block_size // 2, 0)])
    prior = jnp.asarray(2.0 * rng.standard_normal((b, self.hq, self.t)), jnp.float32)
    return (q, k, v, jnp.asarray(idx, jnp.int32), jnp.asarray(n_valid, jnp.int32),
            jnp.asarray(length, jnp.int32), prior)


@st.composite
def cases(draw, max_t=1024, max_list=12, windows=None, groups=(1, 2, 3, 4, 8)):
  block_size = draw(st.sampled_from((16, 32, 64)))
  num_blocks = draw(st.integers(1, max_t // block_size))
  return Case(
      batch=draw(st.integers(1, 2)), hkv=draw(st.integers(1, 2)),
      group=draw(st.sampled_from(groups)), head_dim=draw(st.sampled_from((64, 128))),
      block_size=block_size, num_blocks=num_blocks,
      list_len=draw(st.integers(1, min(num_blocks, max_list))), per_head=draw(st.booleans()),
      dtype=draw(st.sampled_from(DTYPES)), seed=draw(st.integers(0, 2**31 - 1)),
      num_splits=draw(st.sampled_from((None, 1, 2, 3, 7))),
      window=1 if windows is None else draw(st.sampled_from(windows)),
      multi=windows is not None)


F32, BF16 = jnp.float32, jnp.bfloat16
# Fixed shapes (jit caches hit across examples; the data, lists, n_valid and lengths are fresh
# per example). Together they cover G in {1,2,3,4,8}, Hkv 1-2, D 64/128, block 16/32/64,
# T 256..1536, both selection layouts, both dtypes, and split counts 1, heuristic, < n and > n.
# Fields: batch, hkv, group, head_dim, block_size, num_blocks, list_len, per_head, dtype,
# num_splits.
POOL = [
    (1, 1, 1, 64, 16, 64, 12, False, F32, None),
    (2, 2, 3, 64, 32, 20, 7, False, BF16, 3),
    (2, 1, 8, 128, 64, 16, 9, False, BF16, 2),
    (1, 2, 4, 128, 16, 96, 12, True, F32, 1),
    (2, 2, 3, 128, 32, 8, 8, True, BF16, 11),
]
# Token lists (block_size 1: an entry is one slot, ``num_blocks`` the slots): longer lists than
# a split's 256-token floor (several splits, given or heuristic), one shorter than a tile.
TOKEN_POOL = [
    (2, 2, 3, 64, 1, 320, 90, False, BF16, None),
    (1, 2, 4, 64, 1, 640, 560, True, F32, 3),
    (2, 1, 2, 128, 1, 96, 10, True, BF16, 2),
]
_FIELDS = ("batch", "hkv", "group", "head_dim", "block_size", "num_blocks", "list_len",
           "per_head", "dtype", "num_splits")


@st.composite
def pooled_cases(draw, windows=None, pool=None):
  """A case with a shape from ``pool`` (default ``POOL``; and a window from ``windows``) and a
  fresh seed."""
  shape = dict(zip(_FIELDS, draw(st.sampled_from(POOL if pool is None else pool))))
  if windows is not None:
    shape.update(window=draw(st.sampled_from(windows)), multi=True)
  return Case(**shape, seed=draw(st.integers(0, 2**31 - 1)))


def assert_attention_close(out, lse, ref_out, ref_lse, dtype):
  """Same empty rows (out 0, lse -inf), no NaN, and allclose elsewhere at the dtype's tolerance."""
  atol, rtol, lse_atol = TOLS[dtype]
  out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  assert lse.dtype == np.float32
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  empty = np.isneginf(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), empty)
  assert np.isfinite(lse[~empty]).all()
  assert (out[empty] == 0).all()
  np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=lse_atol, rtol=0)
  np.testing.assert_allclose(out, ref_out, atol=atol, rtol=rtol)
