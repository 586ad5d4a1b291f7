"""One attend rule on the Pallas and jnp paths: ``slot < length`` and ``pos >= 0``.

A compacted cache (eviction, ``sparse_attn.compression.compact``) keeps a different number of
keys per head, so heads that kept fewer have empty slots (``pos = -1``, zero K/V) below
``length``. Every sparse-decode path must skip them: the three kernels in interpret mode, their
jnp references, and ``sparse_attn``'s decode, all equal a brute-force numpy softmax over the
keys the cache really holds.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (sparse_decode, sparse_decode_multiquery,
                            sparse_decode_multiquery_reference, sparse_decode_resa,
                            sparse_decode_resa_reference, sparse_decode_reference)
from pallas_kernels.shapes import S, kernel_avals
from sparse_attn import cache as cache_lib
from sparse_attn import kernels
from sparse_attn.compression.compact import compact
from sparse_attn.selection import Selection

B, HKV, G, D, BS, T, C = 2, 2, 2, 32, 16, 96, 64
HQ = HKV * G


def _compacted(rng):
  """A cache compacted from ``T`` to ``C`` slots, keeping a different count per head."""
  c = cache_lib.init_cache(B, HKV, T, D, BS)
  pos = np.tile(np.arange(90), (B, 1)).astype(np.int32)
  pos[1, 70:] = -1  # row 1 holds 70 tokens
  k = jnp.asarray(rng.standard_normal((B, HKV, 90, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, HKV, 90, D)), jnp.float32)
  c = cache_lib.write(c, k, v, jnp.asarray(pos))
  keep = rng.random((B, HKV, T)) < np.array([0.65, 0.35])[None, :, None]  # head 1 keeps fewer
  new, _ = compact(c, jnp.asarray(keep), C)
  valid = np.asarray(new.valid)
  below = np.arange(C)[None, None, :] < np.asarray(new.length)[:, None, None]
  assert (below & ~valid).any(), "the test needs holes below length"
  return new


def _brute(q, cache, listed, limit=None):
  """numpy softmax of ``q [B, HQ, W, D]`` over the valid listed keys ``listed [B, HQ, C]``,
  keys at positions ``<= limit [B, W]`` when given; ``(out, lse)`` ``[B, HQ, W, ...]``."""
  k, v = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
  valid, pos = np.asarray(cache.valid), np.asarray(cache.pos)
  qn = np.asarray(q, np.float64)
  w = qn.shape[2]
  out = np.zeros(qn.shape)
  lse = np.full(qn.shape[:3], -np.inf)
  for b in range(B):
    for h in range(HQ):
      kh = h // G
      for i in range(w):
        ok = valid[b, kh] & listed[b, h]
        if limit is not None:
          ok &= pos[b, kh] <= limit[b, i]
        if not ok.any():
          continue
        s = k[b, kh, ok] @ qn[b, h, i] / np.sqrt(D)
        m = s.max()
        p = np.exp(s - m)
        out[b, h, i] = p @ v[b, kh, ok] / p.sum()
        lse[b, h, i] = m + np.log(p.sum())
  return out, lse


def _selection(rng, per_head):
  """Random distinct block lists (3 of 4 blocks) and the listed slots per query head."""
  hs, nb = (HQ if per_head else HKV), C // BS
  idx = np.stack([[rng.permutation(nb)[:3] for _ in range(hs)] for _ in range(B)]).astype(np.int32)
  n_valid = np.full((B, hs), 3, np.int32)
  n_valid[0, 0] = 2
  listed = np.zeros((B, hs, C), bool)
  for b in range(B):
    for h in range(hs):
      for blk in idx[b, h, :n_valid[b, h]]:
        listed[b, h, blk * BS:(blk + 1) * BS] = True
  listed = np.repeat(listed, HQ // hs, axis=1)
  return jnp.asarray(idx), jnp.asarray(n_valid), listed


def _close(got, want, atol=2e-5):
  got = np.asarray(got, np.float64)
  assert np.array_equal(np.isneginf(got), np.isneginf(want))
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], atol=atol, rtol=atol)


@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_decode_skips_holes_on_both_paths(per_head):
  rng = np.random.default_rng(0)
  cache = _compacted(rng)
  idx, n_valid, listed = _selection(rng, per_head)
  q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.float32)
  want_o, want_l = _brute(q[:, :, None], cache, listed)
  args = (q, cache.k, cache.v, idx, n_valid, cache.length)
  for out, lse in (
      sparse_decode(*args, block_size=BS, impl="pallas", interpret=True, pos=cache.pos),
      sparse_decode_reference(*args, block_size=BS, pos=cache.pos)):
    _close(out, want_o[:, :, 0])
    _close(lse, want_l[:, :, 0])
  sel = Selection(idx=idx, n_valid=n_valid, granularity=BS)
  for impl in ("xla", "pallas"):  # sparse_attn's decode passes the cache's positions
    out, lse = kernels.sparse_decode(q, cache, sel, impl=impl, interpret=True)
    _close(out, want_o[:, :, 0])
    _close(lse, want_l[:, :, 0])


def test_resa_kernel_skips_holes_in_both_partials():
  rng = np.random.default_rng(1)
  cache = _compacted(rng)
  idx, n_valid, listed = _selection(rng, False)
  q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.float32)
  prior = jnp.asarray(rng.standard_normal((B, HQ, C)), jnp.float32)
  # The prior partial is a softmax of the prior logits over the same slots: brute force it as
  # attention with logits = prior (a query whose scaled dot product reproduces them is not
  # needed: compare against the masked softmax directly).
  valid = np.asarray(cache.valid)
  ok = listed & np.repeat(valid, G, axis=1)
  pr = np.where(ok, np.asarray(prior, np.float64), -np.inf)
  m = pr.max(-1, keepdims=True)
  p = np.exp(pr - m)
  vv = np.repeat(np.asarray(cache.v, np.float64), G, axis=1)
  want_po = np.einsum("bnt,bntd->bnd", p, vv) / p.sum(-1)[..., None]
  want_pl = m[..., 0] + np.log(p.sum(-1))
  want_o, want_l = _brute(q[:, :, None], cache, listed)
  args = (q, cache.k, cache.v, prior, idx, n_valid, cache.length)
  for out, lse, po, pl, seen in (
      sparse_decode_resa(*args, block_size=BS, impl="pallas", interpret=True, pos=cache.pos),
      sparse_decode_resa_reference(*args, block_size=BS, pos=cache.pos)):
    np.testing.assert_array_equal(seen, ok.sum(-1))  # holes are no prior member
    _close(out, want_o[:, :, 0])
    _close(lse, want_l[:, :, 0])
    _close(po, want_po, atol=1e-4)
    _close(pl, want_pl)


def test_multiquery_limits_by_token_position_and_skips_holes():
  rng = np.random.default_rng(2)
  cache = _compacted(rng)
  idx, n_valid, listed = _selection(rng, False)
  w = 2
  q = jnp.asarray(rng.standard_normal((B, HQ, w, D)), jnp.float32)
  block_mask = jnp.ones((B, HKV, w, idx.shape[-1]), bool)
  # Causal limits by token position (a compacted slot holds a later position than its index).
  limit = np.array([[40, 88], [30, 69]], np.int32)
  want_o, want_l = _brute(q, cache, listed, limit)
  args = (q, cache.k, cache.v, idx, n_valid, block_mask, jnp.asarray(limit), cache.length)
  for out, lse in (
      sparse_decode_multiquery(*args, block_size=BS, impl="pallas", interpret=True,
                               pos=cache.pos),
      sparse_decode_multiquery_reference(*args, block_size=BS, pos=cache.pos)):
    _close(out, want_o)
    _close(lse, want_l)


def test_without_pos_every_slot_below_length_counts():
  """``pos=None`` keeps the uncompacted meaning (slot == position) on both paths."""
  rng = np.random.default_rng(3)
  cache = _compacted(rng)
  idx, n_valid, listed = _selection(rng, False)
  q = jnp.asarray(rng.standard_normal((B, HQ, D)), jnp.float32)
  full = cache_lib.KVCache(**{**{f: getattr(cache, f) for f in
                                 ("k", "v", "length", "kmin", "kmax", "kcen", "krad", "kdev")},
                              "pos": jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32),
                                                      cache.pos.shape)}, block_size=BS)
  want_o, want_l = _brute(q[:, :, None], full, listed)
  args = (q, cache.k, cache.v, idx, n_valid, cache.length)
  for out, lse in (sparse_decode(*args, block_size=BS, impl="pallas", interpret=True),
                   sparse_decode_reference(*args, block_size=BS)):
    _close(out, want_o[:, :, 0])
    _close(lse, want_l[:, :, 0])


@pytest.mark.parametrize("kernel", ["sparse_decode", "sparse_decode_resa",
                                    "sparse_decode_multiquery"])
def test_pos_variant_lowers_for_cuda(kernel):
  from test_pk_lowering import TRITON_CALL, export_cuda  # pylint: disable=g-import-not-at-top
  fn, avals, bs = kernel_avals(kernel, "smollm2", False)
  cache = avals[1]
  pos = S(cache.shape[:3], jnp.int32)
  text = export_cuda(lambda *a: fn(*a[:-1], pos=a[-1], block_size=bs, impl="pallas"),
                     *avals, pos)
  assert TRITON_CALL in text
