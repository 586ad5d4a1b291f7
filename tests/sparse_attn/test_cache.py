"""KVCache: writes, digests kept in sync, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from sparse_attn import cache as cache_lib
from tests.sparse_attn import helpers


def _np_digests(k, valid, bs):
  """Brute-force digests from the full cache state (numpy, float64)."""
  k = np.asarray(k, np.float64)
  valid = np.asarray(valid)
  b, h, t, d = k.shape
  nb = t // bs
  kmin = np.zeros((b, h, nb, d)); kmax = np.zeros((b, h, nb, d))
  kcen = np.zeros((b, h, nb, d)); krad = np.zeros((b, h, nb))
  for i in range(b):
    for j in range(h):
      for n in range(nb):
        sl = slice(n * bs, (n + 1) * bs)
        keys = k[i, j, sl][valid[i, j, sl]]
        if len(keys):
          kmin[i, j, n] = keys.min(0); kmax[i, j, n] = keys.max(0)
          kcen[i, j, n] = keys.mean(0)
          krad[i, j, n] = np.linalg.norm(keys - kcen[i, j, n], axis=-1).max()
  return kmin, kmax, kcen, krad


# One program per write shape instead of one per primitive op (eager): the same writes, fewer
# compilations (jit vs eager equality: test_write_under_jit_and_vmap_equals_plain).
_write = jax.jit(cache_lib.write)


@given(seed=st.integers(0, 2**31 - 1), bs=st.sampled_from([1, 4, 16]),
       nwrites=st.integers(1, 6), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_digests_after_arbitrary_writes_equal_recomputation(seed, bs, nwrites, dtype):
  """Any sequence of appends/overwrites (incl. padding slots) leaves exact digests."""
  rng = np.random.default_rng(seed)
  b, h, d = 2, 2, 8
  t = bs * int(rng.integers(2, 6))
  c = cache_lib.init_cache(b, h, t, d, bs, dtype)
  for _ in range(nwrites):
    s = int(rng.integers(1, t + 1))
    pos = np.stack([rng.permutation(t)[:s] for _ in range(b)]).astype(np.int32)
    pos[rng.random(pos.shape) < 0.2] = -1  # padding entries are skipped
    c = _write(c, helpers.normal(rng, (b, h, s, d), dtype),
               helpers.normal(rng, (b, h, s, d), dtype), jnp.asarray(pos))
  want = _np_digests(c.k, c.valid, bs)
  got = (c.kmin, c.kmax, c.kcen, c.krad)
  for w, g in zip(want, got):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, **helpers.tol(dtype))


def test_partial_block_digest_uses_valid_keys_only():
  c = cache_lib.init_cache(1, 1, 8, 2, 4)
  k = jnp.array([[[[1.0, -2.0], [3.0, 5.0], [-1.0, 0.0]]]])
  c = cache_lib.write(c, k, k, jnp.array([[0, 1, 2]]))
  np.testing.assert_array_equal(c.kmin[0, 0, 0], [-1.0, -2.0])
  np.testing.assert_array_equal(c.kmax[0, 0, 0], [3.0, 5.0])
  np.testing.assert_array_equal(c.kmin[0, 0, 1], [0.0, 0.0])  # empty block
  assert int(c.length[0]) == 3


def test_overwrite_updates_digest_and_keeps_length():
  c = cache_lib.init_cache(1, 1, 8, 1, 4)
  c = cache_lib.write(c, jnp.ones((1, 1, 6, 1)) * 5, jnp.ones((1, 1, 6, 1)), jnp.arange(6)[None])
  c = cache_lib.write(c, -jnp.ones((1, 1, 1, 1)), jnp.ones((1, 1, 1, 1)), jnp.array([[1]]))
  assert float(c.kmin[0, 0, 0, 0]) == -1.0 and float(c.kmax[0, 0, 0, 0]) == 5.0
  assert int(c.length[0]) == 6
  np.testing.assert_array_equal(c.pos[0, 0], [0, 1, 2, 3, 4, 5, -1, -1])


def test_write_under_jit_and_vmap_equals_plain():
  rng = np.random.default_rng(0)
  caches = [helpers.filled_cache(rng, 2, 2, 32, 8, [5, 17]) for _ in range(3)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *caches)
  k = helpers.normal(rng, (3, 2, 2, 2, 8))
  pos = jnp.array([[5, 6], [17, 18]])
  plain = [cache_lib.write(c, k[i], k[i], pos) for i, c in enumerate(caches)]
  vm = jax.jit(jax.vmap(cache_lib.write, in_axes=(0, 0, 0, None)))(stacked, k, k, pos)
  for i, p in enumerate(plain):
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(jax.tree.map(lambda x: x[i], vm))):
      np.testing.assert_array_equal(a, b)


def test_errors_name_the_numbers():
  with pytest.raises(ValueError, match="capacity 30 .* block_size 16"):
    cache_lib.init_cache(1, 1, 30, 4, 16)
  c = cache_lib.init_cache(1, 2, 16, 4, 16)
  with pytest.raises(ValueError, match="slot 16 past the cache capacity 16"):
    cache_lib.write(c, jnp.zeros((1, 2, 1, 4)), jnp.zeros((1, 2, 1, 4)), jnp.array([[16]]))
  with pytest.raises(ValueError, match=r"shape \(1, 2, 1, 8\), expected \(1, 2, 1, 4\)"):
    cache_lib.write(c, jnp.zeros((1, 2, 1, 8)), jnp.zeros((1, 2, 1, 8)), jnp.array([[0]]))
  with pytest.raises(ValueError, match="dtype bfloat16"):
    cache_lib.write(c, jnp.zeros((1, 2, 1, 4), jnp.bfloat16), jnp.zeros((1, 2, 1, 4)),
                    jnp.array([[0]]))


def test_gather_blocks_per_head_reads_its_kv_head():
  rng = np.random.default_rng(1)
  c = helpers.filled_cache(rng, 1, 2, 32, 4, [32], block_size=8)
  idx = jnp.array([[[3, 0], [1, 2], [0, 0], [2, 3]]])  # 4 query heads, G=2
  got = cache_lib.gather_blocks(c.k, idx, 8)
  for h in range(4):
    for j in range(2):
      blk = int(idx[0, h, j])
      np.testing.assert_array_equal(got[0, h, j * 8:(j + 1) * 8],
                                    c.k[0, h // 2, blk * 8:(blk + 1) * 8])


@pytest.mark.parametrize("digests", [(), ("box",), ("sphere",), ("box", "sphere"),
                                     ("box", "mean_box"), ("mean_box",)])
def test_a_cache_keeps_only_the_digest_kinds_asked_for(digests):
  """Absent kinds have zero blocks through writes (jit), long writes and re-storage; the kept
  ones equal a full cache's."""
  rng = np.random.default_rng(0)
  b, hkv, t, d, bs = 2, 2, 64, 8, 8
  full = cache_lib.init_cache(b, hkv, t, d, bs)
  mine = cache_lib.init_cache(b, hkv, t, d, bs, digests=digests)
  k, v = (helpers.normal(rng, (b, hkv, 40, d), jnp.float32, 1.0) for _ in range(2))
  pos = jnp.broadcast_to(jnp.arange(40)[None], (b, 40)).astype(jnp.int32)
  write = jax.jit(cache_lib.write)
  full, mine = write(full, k, v, pos), write(mine, k, v, pos)  # 40 slots: every block
  one = lambda c: write(c, k[:, :, :1], v[:, :, :1], jnp.full((b, 1), 41, jnp.int32))
  full, mine = one(full), one(mine)  # one slot: the per-block refresh
  store = lambda c: cache_lib.replace_storage(c, c.k, c.v, c.pos, c.length)
  for got, want in ((mine, full), (store(mine), store(full))):
    for kind, names in (("box", ("kmin", "kmax")), ("sphere", ("kcen", "krad")),
                        ("mean_box", ("kdev",))):
      assert got.has_digests(kind) == (kind in digests)
      for name in names:
        arr = getattr(got, name)
        if kind in digests:
          np.testing.assert_array_equal(arr, getattr(want, name))
        else:
          assert arr.shape[2] == 0
  with pytest.raises(ValueError, match="unknown digest kind"):
    cache_lib.init_cache(b, hkv, t, d, bs, digests=("ball",))


_KIND_FIELDS = (("box", ("kmin", "kmax")), ("sphere", ("kcen", "krad")), ("mean_box", ("kdev",)),
                ("cosine", ("kcos",)))


@given(seed=st.integers(0, 2**31 - 1), have=st.sets(st.sampled_from(cache_lib.DIGEST_KINDS)),
       want=st.sets(st.sampled_from(cache_lib.DIGEST_KINDS)), n=st.integers(2, 60))
def test_with_digests_equals_the_digests_writes_keep(seed, have, want, n):
  """A cache written with some kinds, given others by ``with_digests`` (the compression
  prefill's cache handed to a selector), equals one written with those kinds: min / max bit
  for bit, the averaged kinds to float rounding; kinds not asked for have zero blocks."""
  rng = np.random.default_rng(seed)
  b, hkv, t, d, bs = 2, 2, 64, 8, 8
  k, v = (helpers.normal(rng, (b, hkv, n, d), jnp.float32, 1.0) for _ in range(2))
  pos = jnp.broadcast_to(jnp.arange(n)[None], (b, n)).astype(jnp.int32)
  pos = pos.at[1, n // 2:].set(-1)  # a shorter row: padding writes nothing
  write = lambda c: cache_lib.write(cache_lib.write(c, k[:, :, :-1], v[:, :, :-1], pos[:, :-1]),
                                    k[:, :, -1:], v[:, :, -1:], pos[:, -1:])
  wanted = tuple(sorted(want))
  ref = write(cache_lib.init_cache(b, hkv, t, d, bs, digests=wanted))
  got = jax.jit(cache_lib.with_digests, static_argnums=1)(
      write(cache_lib.init_cache(b, hkv, t, d, bs, digests=tuple(sorted(have)))), wanted)
  for kind, names in _KIND_FIELDS:
    assert got.has_digests(kind) == (kind in want), kind
    for name in names:
      a, e = np.asarray(getattr(got, name)), np.asarray(getattr(ref, name))
      assert a.shape == e.shape, name
      if name == "kcos" and a.shape[2]:  # a block with no key: 0 written, 1 computed
        filled = np.asarray(ref.valid).reshape(b, hkv, t // bs, bs).any(-1)
        a, e = a[filled], e[filled]
      if name in ("kmin", "kmax"):
        np.testing.assert_array_equal(a, e)
      else:
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-6, err_msg=name)


def test_methods_keep_the_digests_their_selector_reads():
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top
  kinds = lambda m: tuple(k for k in cache_lib.DIGEST_KINDS
                          if m.init_cache(1, 2, 64, 8).has_digests(k))
  assert kinds(methods.make("dense", block_size=8)) == ("box",)  # every cache's (cache.py)
  assert kinds(methods.make("quest+resa", budget=0.25, block_size=8)) == ("box",)
  assert kinds(methods.make("arkvale", budget=0.25, block_size=8)) == ("box", "mean_box")
  assert kinds(methods.make("arkvale:variant=sphere", budget=0.25, block_size=8)) == (
      "box", "sphere")
  assert kinds(methods.make("arkvale:variant=cuboid", budget=0.25, block_size=8)) == ("box",)
  assert kinds(methods.make("topk", budget=0.25, block_size=8)) == ("box",)
  assert kinds(methods.make("snapkv", ratio=0.5, block_size=8)) == ("box",)


def test_a_selector_on_a_cache_without_its_digests_says_so():
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top
  quest_cache = methods.make("quest", budget=0.25, block_size=8).init_cache(1, 2, 64, 8)
  q = jnp.ones((1, 4, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"arkvale reads the \['mean_box'\] block digests"):
    methods.make("arkvale", budget=0.25, block_size=8).select(q, quest_cache)
