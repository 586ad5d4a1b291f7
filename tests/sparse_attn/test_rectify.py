"""ReSA dense rectification (Sun et al. 2025) at layer level, and the enhancer spec grammar."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import cache as cache_lib
from sparse_attn import methods
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn.enhancers import rectify

B, HQ, HKV, D, T, BS = 2, 4, 2, 16, 64, 8
KW = dict(budget=0.25, block_size=BS, n_sink=2, local_window=8)


def _rand(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _decoded(m, rng, prompt=30, steps=4):
  cache, state = m.init_cache(B, HKV, T, D), m.init_state(B, HQ, HKV, D, T)
  pos = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (B, prompt))
  _, cache, state = jax.jit(m.prefill)(_rand(rng, B, HQ, prompt, D), _rand(rng, B, HKV, prompt, D),
                                       _rand(rng, B, HKV, prompt, D), cache, state, pos)
  cache, state = jax.jit(m.end_prefill)(cache, state)
  dec = jax.jit(m.decode)
  w = m.window
  outs = []
  for t in range(prompt, prompt + steps):
    p = jnp.broadcast_to(jnp.arange(t - w + 1, t + 1, dtype=jnp.int32), (B, w))
    out, cache, state = dec(_rand(rng, B, HQ, w, D), _rand(rng, B, HKV, w, D),
                            _rand(rng, B, HKV, w, D), cache, state, p)
    outs.append(out[:, :, -1])
  return cache, state, outs


@pytest.mark.parametrize("spec", ["quest+rect:f=4", "quest+resa+rect:f=4+retro:w=3"])
def test_rectify_overwrites_kv_digests_and_attends_densely(spec):
  m = methods.make(spec, **KW)
  assert m.rect_interval == 4
  rng = np.random.default_rng(0)
  cache, state, _ = _decoded(m, rng)
  pos = jnp.broadcast_to(jnp.arange(30, 34, dtype=jnp.int32), (B, 4))
  q, k, v = _rand(rng, B, HQ, 4, D), _rand(rng, B, HKV, 4, D), _rand(rng, B, HKV, 4, D)
  out, new, state = jax.jit(m.rectify)(q, k, v, cache, state, pos)
  np.testing.assert_array_equal(new.k[:, :, 30:34], k)
  np.testing.assert_array_equal(new.v[:, :, 30:34], v)
  np.testing.assert_array_equal(new.k[:, :, :30], cache.k[:, :, :30])  # the rest untouched
  fresh = cache_lib.block_digests(new.k, new.valid, BS)
  assert new.has_digests("box")  # Quest's; the sphere digests are not kept for Quest
  for a, b in zip((new.kmin, new.kmax, new.kcen, new.krad), fresh):
    if a.shape[2]:
      np.testing.assert_allclose(a, b, atol=1e-6)
  want, _ = dense_over_cache(q, new, pos)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
  if state.retro is not None:  # the output cache takes the dense outputs, with nothing left to add
    ring = state.retro.ring
    np.testing.assert_array_equal(np.sort(np.asarray(ring["pos"]), -1), [[32, 33]] * B)
    assert np.all(np.asarray(ring["full"]))
    for s, p in enumerate(np.asarray(ring["pos"])[0]):
      np.testing.assert_allclose(ring["out"][:, :, s], want[:, :, p - 30], atol=1e-5)


def test_never_rectifying_is_the_selector():
  base = methods.make("quest+resa", **KW)
  for f in (0, "inf", float("inf"), None):
    m = methods.make("quest+resa+rect", f=f, **KW)
    assert m.rect_interval == 0
    assert dataclasses.replace(m, spec=base.spec) == base
  a = _decoded(methods.make("quest+rect:f=inf", **KW), np.random.default_rng(1))[2]
  b = _decoded(methods.make("quest", **KW), np.random.default_rng(1))[2]
  np.testing.assert_array_equal(a, b)


def test_memory_access_model():
  m = methods.make("quest+rect", p=0.1, gqa="group", block_size=16)
  assert m.rect_interval == rectify.DEFAULT_F == 32
  assert m.memory_access() == pytest.approx(1 / 16 + 0.1 + 1 / 32)
  assert methods.make("quest", budget=0.05).memory_access() == pytest.approx(1 / 16 + 0.05)
  assert methods.make("quest+rect:f=8", budget=64).memory_access(1024) == pytest.approx(
      1 / 16 + 1 / 16 + 1 / 8)


def test_spec_grammar():
  m = methods.make("quest:gqa=group+resa:lam=0.5,prior_update=prefill_only+rect:f=16+retro:w=4",
                   budget=0.1)
  assert (m.selector.gqa, m.resa.lam, m.resa.prior_update, m.rect_interval, m.window) == (
      "group", 0.5, "prefill_only", 16, 4)
  a = methods.make("topk+retro+resa", budget=32, lam=0.25, w=3, typical_query="last")
  b = methods.make("topk+resa+retro", budget=32, lam=0.25, w=3, typical_query="last")
  assert dataclasses.replace(a, spec="") == dataclasses.replace(b, spec="")
  assert (a.resa.lam, a.window, a.resa.typical_query, a.granularity) == (0.25, 3, "last", 1)
  assert methods.make("quest+resa:lam=0.5", lam=0.7).resa.lam == 0.7  # keywords win, as for selectors
  defaults = methods.make("arkvale+resa+rect+retro")
  assert (defaults.resa.lam, defaults.rect_interval, defaults.window) == (1.0, 32, 2)
  bad = [("quest+foo", {}, "valid: ['rect', 'resa', 'retro']"),
         ("quest+resa+resa", {}, "twice"),
         ("dense+resa", {}, "need a selector"),
         ("quest+resa:f=3", {}, "valid options: ['fused', 'lam', 'lam_form', 'prior_update', 'typical_query']"),
         ("quest+resa", dict(w=2), "unknown option"),
         ("quest", dict(lam=1.0), "unknown option"),
         ("quest+resa", dict(lam=-1), "lam"),
         ("quest+resa", dict(prior_update="sometimes"), "incremental"),
         ("quest+retro", dict(w=9), "[1, 8]"),
         ("quest+rect", dict(f=-2), "non-negative")]
  for spec, kw, msg in bad:
    with pytest.raises(ValueError, match=None) as e:
      methods.make(spec, **kw)
    assert msg in str(e.value), (spec, str(e.value))
