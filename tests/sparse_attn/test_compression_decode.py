"""Decode-time compression keeps the cache at its budget; jit and vmap equal the plain call;
a chunk read after the prompt (``extend``) equals decode steps."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import flat

B, HQ, HKV, D = 2, 2, 1, 8
L, T = 32, 64
STEPS = 2000


def prompt(seed, b=B):
  key = jax.random.PRNGKey(seed)
  kq, kk, kv = jax.random.split(key, 3)
  pos = jnp.tile(jnp.arange(L), (b, 1))
  return (jax.random.normal(kq, (b, HQ, L, D)), jax.random.normal(kk, (b, HKV, L, D)),
          jax.random.normal(kv, (b, HKV, L, D)), pos)


@pytest.mark.parametrize("name,opts,budget", [
    ("expected_attention", dict(phase="both", ratio=0.5, rope_theta=1e4, head_budget="uniform"),
     16),  # interval 512
    ("tova", dict(phase="both", ratio=0.5), 16),  # one token evicted per step
    ("streaming_llm", dict(phase="decode", max_tokens=20, interval=7), 20),
])
def test_decode_compression_keeps_cache_at_budget(name, opts, budget):
  m = methods.make(name, **opts)
  q, k, v, pos = prompt(0)
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  _, cache, state = jax.jit(m.prefill)(q, k, v, cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  cap = cache.capacity
  assert cap == m.round_capacity(max(budget, L if m.phase == "decode" else budget) + m.interval)
  nbytes = cache.nbytes()

  @jax.jit
  def generate(cache, state):
    def step(carry, i):
      cache, state = carry
      kq, kk, kv = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(1), i), 3)
      out, cache, state = m.decode(
          jax.random.normal(kq, (B, HQ, 1, D)), jax.random.normal(kk, (B, HKV, 1, D)),
          jax.random.normal(kv, (B, HKV, 1, D)), cache, state, jnp.full((B, 1), L + i))
      return (cache, state), (jnp.sum(cache.valid, -1), state["since"], out)
    return jax.lax.scan(step, (cache, state), jnp.arange(STEPS))

  (cache, state), (count, since, out) = generate(cache, state)
  count, since = np.asarray(count), np.asarray(since)
  assert np.all(np.isfinite(np.asarray(out)))
  assert cache.capacity == cap and cache.nbytes() == nbytes
  assert count.max() <= budget + m.interval
  assert np.all(count[since == 0] == budget)  # right after every compression: the budget
  assert (since == 0).sum() >= STEPS // (m.interval + 1)
  # tokens are kept with their own positions; the newest token is always in the cache
  for b in range(B):
    last = np.asarray(cache.pos)[b, 0][np.asarray(cache.valid)[b, 0]]
    assert len(set(last.tolist())) == len(last) and last.max() == L + STEPS - 1
  if name == "streaming_llm":
    pos = np.sort(np.asarray(cache.pos)[0, 0][np.asarray(cache.valid)[0, 0]])
    n = count[-1, 0, 0]
    np.testing.assert_array_equal(pos, list(range(4)) + list(range(L + STEPS - n + 4, L + STEPS)))


def _pipeline(m):
  def run(q, k, v, pos, dq, dk, dv):
    b = q.shape[0]
    cache = m.init_cache(b, HKV, T, D)
    state = m.init_state(b, HQ, HKV, D, T)
    out, cache, state = m.prefill(q, k, v, cache, state, pos)
    cache, state = m.end_prefill(cache, state)
    outs = [out]
    for i in range(dq.shape[0]):
      o, cache, state = m.decode(dq[i], dk[i], dv[i], cache, state, jnp.full((b, 1), L + i))
      outs.append(o)
    return outs, cache, state
  return run


# the most stateful (observed attention: per-slot sums and counts); the others alike
@pytest.mark.parametrize("name", ["expected_attention", "observed_attention"])
def test_jit_and_vmap_equal_plain(name):
  m = methods.make(name, ratio=0.5, phase="both", interval=2, decode_slots=T - L,
                   head_budget="adakv", **(dict(window_size=8) if name == "snapkv" else {}))
  run = _pipeline(m)
  probs = [prompt(s) for s in (3, 4)]
  dec = [tuple(jax.random.normal(jax.random.PRNGKey(10 + s), (2, B, h, 1, D))
               for h in (HQ, HKV, HKV)) for s in (3, 4)]
  plain = run(*probs[0], *dec[0])
  jitted = jax.jit(run)(*probs[0], *dec[0])
  stack = lambda *xs: jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)
  batched = jax.jit(jax.vmap(run))(*stack(*[p + d for p, d in zip(probs, dec)]))
  second = jax.jit(run)(*probs[1], *dec[1])
  close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  jax.tree_util.tree_map(close, plain, jitted)
  jax.tree_util.tree_map(close, jax.tree_util.tree_map(lambda x: x[0], batched), jitted)
  jax.tree_util.tree_map(close, jax.tree_util.tree_map(lambda x: x[1], batched), second)
  assert jitted[1].capacity < T


def test_adakv_decode_compression_keeps_the_flat_cache_at_budget():
  """Decode-phase eviction with Ada-KV budgets on the flat layout: the layer keeps ``K n``
  tokens after every compression, the buffer never grows, and StreamingLLM's tied scores give
  every head the sinks and the newest tokens."""
  hkv, budget, interval, steps = 2, 20, 7, 60
  m = methods.make("streaming_llm", phase="decode", max_tokens=budget, interval=interval,
                   head_budget="adakv")
  key = jax.random.PRNGKey(5)
  x = lambda i, h, s: jax.random.normal(jax.random.fold_in(key, i), (B, h, s, D))
  cache = m.init_cache(B, hkv, T, D)
  state = m.init_state(B, HQ, hkv, D, T)
  pos = jnp.tile(jnp.arange(L), (B, 1))
  _, cache, state = jax.jit(m.prefill)(x(0, HQ, L), x(1, hkv, L), x(2, hkv, L), cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  assert isinstance(cache, flat.FlatKVCache)
  cap = cache.capacity
  assert cap == m.round_capacity(hkv * L + hkv * interval)  # the whole prompt, then the room

  @jax.jit
  def generate(cache, state):
    def step(carry, i):
      cache, state = carry
      _, cache, state = m.decode(x(3 * i + 3, HQ, 1), x(3 * i + 4, hkv, 1),
                                 x(3 * i + 5, hkv, 1), cache, state, jnp.full((B, 1), L + i))
      return (cache, state), (flat.per_head_counts(cache), state["since"])
    return jax.lax.scan(step, (cache, state), jnp.arange(steps))

  (cache, state), (count, since) = generate(cache, state)
  count, since = np.asarray(count), np.asarray(since)
  assert cache.capacity == cap
  assert count.sum(-1).max() <= hkv * (budget + interval)
  assert np.all(count[since == 0] == budget)  # right after every compression
  assert (since == 0).sum() >= steps // (interval + 1)
  view = flat.heads_view(cache)
  n = int(count[-1, 0, 0])
  for b in range(B):
    for h in range(hkv):
      kept = np.sort(np.asarray(view.pos)[b, h][np.asarray(view.valid)[b, h]])
      newest = list(range(L + steps - n + 4, L + steps))
      np.testing.assert_array_equal(kept, list(range(4)) + newest)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), s=st.integers(1, 9), data=st.data())
@hypothesis.settings(max_examples=4, deadline=None)
@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "expected_attention:ratio=0.5",
                                  "keydiff:ratio=0.25,head_budget=adakv", "h2o:ratio=0.5"])
def test_extend_equals_decode_steps(spec, seed, s, data):
  """A chunk read after the prompt (``extend``) leaves the cache and outputs ``S`` decode steps
  leave, padding (position -1) anywhere in the chunk included; uniform and flat layouts."""
  hkv = 2
  m = methods.make(spec)
  key = jax.random.PRNGKey(seed)
  x = lambda i, h, n: jax.random.normal(jax.random.fold_in(key, i), (B, h, n, D))
  cache = m.init_cache(B, hkv, T, D)
  state = m.init_state(B, HQ * hkv, hkv, D, T)
  pos = jnp.tile(jnp.arange(L), (B, 1))
  _, cache, state = m.prefill(x(0, HQ * hkv, L), x(1, hkv, L), x(2, hkv, L), cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  ok = np.asarray(data.draw(st.lists(st.lists(st.booleans(), min_size=s, max_size=s),
                                     min_size=B, max_size=B)))
  positions = np.where(ok, L + np.cumsum(ok, axis=1) - 1, -1).astype(np.int32)
  q, k, v = x(3, HQ * hkv, s), x(4, hkv, s), x(5, hkv, s)
  out, got, _ = jax.jit(m.extend)(q, k, v, cache, state, jnp.asarray(positions))
  want = cache
  for j in range(s):
    o, want, state = m.decode(q[:, :, j:j + 1], k[:, :, j:j + 1], v[:, :, j:j + 1], want, state,
                              jnp.asarray(positions[:, j:j + 1]))
    for b in range(B):
      if ok[b, j]:
        np.testing.assert_allclose(out[b, :, j], o[b, :, 0], atol=1e-5, rtol=1e-5)
  for field in ("k", "v", "pos", "length") + (("head",) if isinstance(got, flat.FlatKVCache)
                                                else ()):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_extend_refuses_chunks_with_decode_phase_compression():
  m = methods.make("tova", phase="both", ratio=0.5)
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  q, k, v, pos = prompt(0)
  _, cache, state = m.prefill(q, k, v, cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  with pytest.raises(NotImplementedError, match="one decode step at a time"):
    m.extend(q[:, :, :2], k[:, :, :2], v[:, :, :2], cache, state, pos[:, :2] + L)
  with pytest.raises(NotImplementedError, match="only dense and compression"):
    methods.make("quest", budget=0.25).extend(q, k, v, cache, state, pos)
