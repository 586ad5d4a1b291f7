"""The selectors: validated once, hashable, and the one selection path of every Method."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods, selection
from sparse_attn.budget import Budget
from sparse_attn.cache import init_cache, write
from sparse_attn.selectors import ArkVale, Quest
from tests.sparse_attn import helpers


def _cache(rng, b=2, hkv=2, t=96, d=16, bs=8, lengths=(90, 41)):
  cache = init_cache(b, hkv, t, d, bs)
  pos = np.full((b, t), -1, np.int32)
  for i, n in enumerate(lengths):
    pos[i, :n] = np.arange(n)
  k, v = (helpers.normal(rng, (b, hkv, t, d), jnp.float32, 1.0) for _ in range(2))
  return write(cache, k, v, jnp.asarray(pos))


@pytest.mark.parametrize("spec, bad, match", [
    ("oracle", {}, "unknown method 'oracle'"),
    ("quest", dict(gqa="layer"), "gqa must be one of"),
    ("arkvale", dict(variant="box"), "variant must be one of"),
    ("topk", dict(topp=0.9), r"unknown option\(s\) \['topp'\] for 'topk'"),
    ("quest", dict(topp=0.9, adakv=0.2), "either topp or adakv"),
    ("quest", dict(topp=1.5), r"topp must be in \(0, 1\]"),
    ("quest", dict(adakv=-0.1), r"adakv floor must be in \[0, 1\]"),
])
def test_invalid_options_are_refused_with_the_valid_ones(spec, bad, match):
  with pytest.raises(ValueError, match=match):
    methods.make(spec, budget=0.1, block_size=8, **bad)


def test_make_builds_the_selector_and_validates_through_it():
  m = methods.make("arkvale:variant=cuboid,gqa=group", budget=0.2, block_size=8, topp=0.8)
  assert m.selector == ArkVale(Budget(budget=0.2), 8, "group", variant="cuboid", topp=0.8)
  assert (m.name, m.granularity, m.selection_heads(8, 2)) == ("arkvale", 8, 2)
  assert methods.make("arkvale").selector.variant == "cuboid-mean"  # ArkVale's own default
  assert methods.make("arkvale:variant=sphere").selector.digests == ("box", "sphere")
  assert methods.make("topk").granularity == 1
  assert methods.make("dense").selector is None and methods.make("dense").name == "dense"
  with pytest.raises(ValueError, match="topp must be a number"):
    methods.make("quest", topp=True)
  with pytest.raises(ValueError, match="block_size 8 != the method's 16"):
    methods.Method(selector=Quest(Budget(budget=0.1), 8), block_size=16)
  hash(m)  # a jit static argument


@pytest.mark.parametrize("spec", ["quest", "quest:gqa=group", "arkvale", "topk", "streaming",
                                  "quest:topp=0.7", "arkvale:adakv=0.3"])
def test_method_select_is_the_selectors_and_jits_with_the_selector_static(spec):
  rng = np.random.default_rng(0)
  m = methods.make(spec, budget=0.25, block_size=8)
  cache = _cache(rng)
  q = helpers.normal(rng, (2, 4, 16), jnp.float32, 1.0)
  a = m.select(q, cache, 0.25)
  b = jax.jit(lambda q, c: m.selector.select(q, c, 0.25))(q, cache)
  assert isinstance(a, selection.Selection) and a.granularity == m.granularity
  np.testing.assert_array_equal(a.token_mask(96), b.token_mask(96))
  heads = m.selection_heads(4, 2)
  assert a.idx.shape[:2] == (2, heads)
  # every selection attends the forced entries and no entry past the row's last token
  mask = np.asarray(a.token_mask(96))
  g = m.granularity
  assert not mask[1, :, -(-41 // g) * g:].any()
  assert mask.sum(-1).min() > 0


@pytest.mark.parametrize("spec", ["quest", "quest:gqa=group", "arkvale"])
def test_pallas_select_chooses_the_top_k_set(spec):
  """Under ``impl="pallas"`` the block selectors pick with the sort-free radix select
  (``kernels.top_ids``): the same entries as ``lax.top_k``, listed in id order."""
  rng = np.random.default_rng(1)
  cache = _cache(rng)
  q = helpers.normal(rng, (2, 4, 16), jnp.float32, 1.0)
  want = methods.make(spec, budget=0.25, block_size=8).select(q, cache, 0.25)
  got = methods.make(spec, budget=0.25, block_size=8, impl="pallas",
                     interpret=True).select(q, cache, 0.25)
  np.testing.assert_array_equal(got.n_valid, want.n_valid)
  np.testing.assert_array_equal(got.token_mask(96), want.token_mask(96))
  valid = np.asarray(got.idx)[..., :int(np.min(got.n_valid))]
  assert (np.diff(valid, axis=-1) > 0).all()
