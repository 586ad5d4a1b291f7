"""Merge on evict (``merge=true``, kvpress's ``MergingPress``) against a numpy transcription of
kvpress's ``MergingPress.merge``, alone and through ``end_prefill`` in both layouts."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import flat, merge_evicted
from tests.sparse_attn import test_compression_invariants as invariants

B, K, T, D = 2, 3, 48, 8


def numpy_merge(k, v, valid, keep, threshold, fraction):
  """``v`` after kvpress's merge of each head's evicted values into its kept ones (float64)."""
  out = v.copy()
  for b in range(k.shape[0]):
    for h in range(k.shape[1]):
      kept = np.flatnonzero(keep[b, h] & valid[b, h])
      gone = np.flatnonzero(valid[b, h] & ~keep[b, h])
      if not len(kept) or not len(gone):
        continue
      unit = k[b, h] / np.maximum(np.linalg.norm(k[b, h], axis=-1, keepdims=True), 1e-6)
      sims = unit[gone] @ unit[kept].T
      s, target = sims.max(1), kept[sims.argmax(1)]
      ok = s >= threshold
      if fraction < 1.0 and ok.any():
        ok &= s >= np.quantile(np.where(ok, s, -np.inf), 1.0 - fraction)
      norm = np.linalg.norm(v[b, h], axis=-1)
      w = np.maximum(s, 0) * ok * norm[gone] / (norm[gone] + norm[target] + 1e-6)
      acc, total = np.zeros_like(v[b, h]), np.zeros(v.shape[2])
      for i, j in zip(gone, target):
        acc[j] += w[gone == i][0] * v[b, h, i]
        total[j] += w[gone == i][0]
      hit = total > 0
      out[b, h, hit] = (v[b, h, hit] + acc[hit]) / (1 + total[hit, None])
  return out


def cache_of(k, v, lengths):
  m = methods.make("dense")
  cache = m.init_cache(B, K, T, D)
  pos = np.where(np.arange(T)[None] < np.asarray(lengths)[:, None], np.arange(T)[None], -1)
  from sparse_attn.cache import write  # pylint: disable=g-import-not-at-top
  return write(cache, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
               jnp.asarray(pos, jnp.int32))


@hypothesis.given(seed=st.integers(0, 2**31 - 1), threshold=st.sampled_from([0.0, 0.3]),
                  fraction=st.sampled_from([1.0, 0.75, 0.4]), keep_p=st.floats(0.05, 0.95),
                  lengths=st.lists(st.integers(1, T), min_size=B, max_size=B),
                  tile=st.sampled_from([4, 128]))
@hypothesis.settings(max_examples=12, deadline=None)
def test_merge_equals_kvpress_transcription(seed, threshold, fraction, keep_p, lengths, tile):
  """Ragged rows, heads that keep every or no token, thresholds, fractions, row tiles."""
  rng = np.random.default_rng(seed)
  k, v = rng.normal(size=(B, K, T, D)) + 0.3, rng.normal(size=(B, K, T, D))
  keep = rng.random((B, K, T)) < keep_p
  keep[0, 0] = True  # keeps all: nothing to merge
  cache = cache_of(k, v, lengths)
  valid = np.asarray(cache.valid)
  sim, target = merge_evicted.nearest_kept(cache.k, jnp.asarray(keep) & cache.valid, tile)
  got = np.asarray(merge_evicted.merge_evicted(cache, jnp.asarray(keep), threshold,
                                               fraction).v)
  want = numpy_merge(k, v, valid, keep, threshold, fraction)
  np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-6)
  assert np.asarray(sim).shape == (B, K, T) and np.asarray(target).max() < T
  if fraction == 1.0 and threshold == 0.0 and keep_p < 0.9 and min(lengths) >= 16:
    assert not np.allclose(got[valid & keep], v[valid & keep])  # something merged


@pytest.mark.parametrize("spec", ["knorm:merge=true", "knorm:merge=true,head_budget=adakv",
                                  "snapkv:merge=true,merge_fraction=0.5,window_size=8"])
def test_end_prefill_keeps_the_same_tokens_with_merged_values(spec):
  """The kept tokens and keys are the method's without merging; each kept value is the
  transcription's, in either layout; decode steps follow; jitted ``end_prefill`` agrees."""
  p = invariants.problem(5)
  m = methods.make(spec, ratio=0.5, n_sink=2)
  plain = methods.make(spec.replace("merge=true", "merge=false"), ratio=0.5, n_sink=2)
  outs, full, cache = invariants.run(m, p)
  _, _, base = invariants.run(plain, p, steps=0)
  view = lambda c: flat.heads_view(c) if isinstance(c, flat.FlatKVCache) else c
  got, ref = view(cache), view(base)
  ok = np.asarray(ref.valid) & (np.asarray(ref.pos) < invariants.L)
  np.testing.assert_array_equal(np.asarray(got.pos)[ok], np.asarray(ref.pos)[ok])
  np.testing.assert_array_equal(np.asarray(got.k)[ok], np.asarray(ref.k)[ok])
  keep = np.zeros(full.pos.shape, bool)  # the prompt slots kept, on the full cache
  for b, h, s in zip(*np.nonzero(ok)):
    keep[b, h, int(np.asarray(ref.pos)[b, h, s])] = True
  fraction = m.merge_fraction
  want = numpy_merge(np.asarray(full.k, np.float64), np.asarray(full.v, np.float64),
                     np.asarray(full.valid), keep, 0.0, fraction)
  for b, h, s in zip(*np.nonzero(ok)):
    np.testing.assert_allclose(np.asarray(got.v)[b, h, s],
                               want[b, h, int(np.asarray(ref.pos)[b, h, s])], rtol=1e-5,
                               atol=1e-6)
  assert not np.allclose(np.asarray(got.v)[ok], np.asarray(ref.v)[ok])
  assert all(np.isfinite(np.asarray(o)).all() for o in outs)


def test_jit_and_vmap():
  rng = np.random.default_rng(0)
  cache = cache_of(rng.normal(size=(B, K, T, D)), rng.normal(size=(B, K, T, D)), [T, 20])
  keep = jnp.asarray(rng.random((B, K, T)) < 0.4)
  want = merge_evicted.merge_evicted(cache, keep, 0.1, 0.5).v
  got = jax.jit(merge_evicted.merge_evicted, static_argnums=(2, 3))(cache, keep, 0.1, 0.5).v
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  mapped = jax.vmap(lambda c, kp: merge_evicted.merge_evicted(c, kp, 0.1, 0.5))(
      jax.tree.map(lambda x: jnp.stack([x, x]), cache), jnp.stack([keep, keep])).v
  np.testing.assert_allclose(mapped[1], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options,match", [
    (dict(merge=1), "merge must be a bool"), (dict(merge_threshold=1.5), "merge_threshold"),
    (dict(merge_fraction=0.0), "merge_fraction")])
def test_bad_options_raise(options, match):
  with pytest.raises(ValueError, match=match):
    methods.make("knorm", ratio=0.5, **options)
  with pytest.raises(ValueError, match="evicts no token"):
    methods.make("think:merge=true", ratio=0.5)
