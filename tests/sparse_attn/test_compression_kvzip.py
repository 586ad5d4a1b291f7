"""KVzip (arXiv 2505.23416, kvpress's ``KVzipPress``) against numpy.

The numpy side, per row, kv head and replay: the softmax of each replay query over the sinks
``< min(n_sink, start)``, the chunk and the replay's own earlier keys; a chunk key's score is
its largest weight over the group and the queries; a layer then keeps its top ``K n`` over
all heads (sinks first), or, ranked over all layers, the count of the model's top entries it
holds (``cross_layer.layer_totals``; end to end: ``tests/models/test_kvzip_replay_model.py``).
The replay writes nothing and its output is exact attention over the cache and itself.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import layer_inputs, methods, reference
from sparse_attn.compression import cross_layer, flat, kvzip, prefill

B, HQ, HKV, D, T, S = 2, 4, 2, 8, 48, 6
G = HQ // HKV
LENGTHS = (40, 29)
SINK = 4


def scores_np(q, k, kown, lengths, spans, col=None, row=None):
  """``col [B, N, T]`` (a key's weight for each query head) and ``row [B, S]`` (a query's): KVzip+
  (each weight times both before the max); None: 1."""
  col = np.ones((B, HQ, T)) if col is None else col
  row = np.ones((B, S)) if row is None else row
  out = np.full((B, HKV, T), -np.inf)
  for b in range(B):
    start, end = spans[b]
    ctx = [i for i in range(lengths[b]) if i < min(SINK, start) or start <= i < end]
    for h in range(HKV):
      best = np.zeros(T)
      for g in range(G):
        for s in range(S):
          keys = np.concatenate([k[b, h, ctx], kown[b, h, :s + 1]])
          a = keys @ q[b, h * G + g, s] / np.sqrt(D)
          w = np.exp(a - a.max())
          w /= w.sum()
          w = w[:len(ctx)] * col[b, h * G + g, ctx] * row[b, s]
          best[ctx] = np.maximum(best[ctx], w)
      out[b, h, start:min(end, lengths[b])] = best[start:min(end, lengths[b])]
  return out


def prefilled(m, rng):
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  pos = np.where(np.arange(T)[None] < np.asarray(LENGTHS)[:, None], np.arange(T)[None], -1)
  k = f(B, HKV, T, D)
  cache = m.init_cache(B, HKV, T + 16, D)
  state = m.init_state(B, HQ, HKV, D, T + 16)
  _, cache, state = jax.jit(m.prefill)(f(B, HQ, T, D), k, f(B, HKV, T, D), cache, state,
                                       jnp.asarray(pos, jnp.int32))
  return cache, state, np.asarray(k)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), split=st.integers(1, 28),
                  chunk=st.sampled_from([40, 2048]))
@hypothesis.settings(max_examples=8, deadline=None)
def test_replay_scores_and_kept_set_match_numpy(seed, split, chunk):
  """(A chunk of 40 gathers the sinks' and the chunk's keys; 2,048 reads every slot.)"""
  rng = np.random.default_rng(seed)
  m = methods.make("kvzip", ratio=0.5, block_size=8, chunk_size=chunk)
  cache, state, k = prefilled(m, rng)
  total = np.full((B, HKV, T), -np.inf)
  step = jax.jit(m.replay)
  for spans in ([(0, split)] * B, [(split, 40), (split, 29)]):  # two chunks per row
    q, kown, vown = (rng.normal(size=(B, n, S, D)) for n in (HQ, HKV, HKV))
    pos = np.asarray(LENGTHS)[:, None] + np.arange(S)[None]
    state = dict(state, span=jnp.asarray(spans, jnp.int32))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    out, new_cache, state = step(f32(q), f32(kown), f32(vown), cache, state,
                                 jnp.asarray(pos, jnp.int32))
    assert new_cache is cache or np.array_equal(new_cache.k, cache.k)  # nothing written
    want = scores_np(q, k, kown, LENGTHS, spans)
    total = np.where(want > -np.inf, want, total)
    # the output: exact attention over the cache and the replay's own keys (causal)
    kk = jnp.concatenate([cache.k, f32(kown)], 2)
    vv = jnp.concatenate([cache.v, f32(vown)], 2)
    kpos = jnp.concatenate([cache.pos, jnp.broadcast_to(jnp.asarray(pos)[:, None],
                                                         (B, HKV, S))], 2)
    ref, _ = reference.attention(f32(q), kk, vv, None, q_positions=jnp.asarray(pos),
                                 k_positions=kpos)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
  got = np.asarray(state["score"])[..., :T]
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(got[b, :, :n], total[b, :, :n], rtol=1e-5, atol=1e-7)
  keep, _ = m.prefill_keep(cache, state)
  keep = np.asarray(keep)[..., :T]
  for b, n in enumerate(LENGTHS):
    score = np.where(np.arange(T) < SINK, np.inf, total[b])[:, :n]  # sinks forced
    want = np.zeros((HKV, n), bool)
    order = np.argsort(-score.reshape(-1), kind="stable")[:HKV * -(-n // 2)]
    want.reshape(-1)[order] = True
    assert keep[b, :, n:].sum() == 0
    assert keep[b, :, :n].sum() == want.sum()
    np.testing.assert_array_equal(np.sort(score[keep[b, :, :n]]), np.sort(score[want]))
  new, _ = m.end_prefill(cache, state)
  assert isinstance(new, flat.FlatKVCache)
  assert int(new.length[0]) == HKV * 20
  # the model-wide ranking's share of this layer (``across_layers``): its top that many
  share = jnp.asarray([7, 50], jnp.int32)
  keep, _ = m.prefill_keep(cache, dict(state, layer_keep=share))
  keep = np.asarray(keep)[..., :T]
  for b, n in enumerate(LENGTHS):
    score = np.where(np.arange(T) < SINK, np.inf, total[b])[:, :n]
    order = np.argsort(-score.reshape(-1), kind="stable")[:int(share[b])]
    want = np.zeros((HKV, n), bool)
    want.reshape(-1)[order] = True
    np.testing.assert_array_equal(keep[b, :, :n], want)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), split=st.integers(1, 28),
                  chunk=st.sampled_from([40, 2048]), with_proj=st.booleans())
@hypothesis.settings(max_examples=6, deadline=None)
def test_kvzip_plus_scores_match_numpy(seed, split, chunk, with_proj):
  """KVzip+ (kvpress's ``kvzip_plus_normalization``): each weight times ``||v_i W^O_h||_2 /
  ||x_s||_2`` before the max; without ``W^O`` (no model) ``||v_i||_2``."""
  rng = np.random.default_rng(seed)
  m = methods.make("kvzip:plus=true", ratio=0.5, block_size=8, chunk_size=chunk)
  cache, state, k = prefilled(m, rng)
  v = np.asarray(cache.v, np.float64)[:, :, :T]
  wo = rng.normal(size=(HQ * D, 12))
  if with_proj:
    state = m.layer_state(state, 0, layer_inputs.LayerInputs(out_proj=jnp.asarray(wo)))
    heads = wo.reshape(HKV, G, D, 12)
    col = np.stack([np.linalg.norm(v[:, h] @ heads[h, g], axis=-1)
                    for h in range(HKV) for g in range(G)], 1)  # [B, N, T]
  else:
    col = np.repeat(np.linalg.norm(v, axis=-1), G, axis=1)
  spans = [(split, 40), (split, 29)]
  q, kown, vown = (rng.normal(size=(B, n, S, D)) for n in (HQ, HKV, HKV))
  norm = rng.uniform(0.5, 4.0, size=(B, S))
  pos = np.asarray(LENGTHS)[:, None] + np.arange(S)[None]
  state = dict(state, span=jnp.asarray(spans, jnp.int32))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  _, _, state = jax.jit(m.replay)(f32(q), f32(kown), f32(vown), cache, state,
                                  jnp.asarray(pos, jnp.int32), hidden_norm=f32(norm))
  want = scores_np(q, k, kown, LENGTHS, spans, col, 1.0 / norm)
  plain = scores_np(q, k, kown, LENGTHS, spans)
  got = np.asarray(state["score"])[..., :T]
  for b, n in enumerate(LENGTHS):
    np.testing.assert_allclose(got[b, :, split:n], want[b, :, split:n], rtol=1e-4, atol=1e-7)
    assert not np.allclose(got[b, :, split:n], plain[b, :, split:n])  # the weights count
  assert "out_proj" not in m.end_prefill(cache, state)[1]  # not carried into decoding


def test_jit_vmap_and_bf16():
  rng = np.random.default_rng(1)
  m = methods.make("kvzip", ratio=0.5)
  cache, state, _ = prefilled(m, rng)
  state = dict(state, span=jnp.asarray([[0, 40], [0, 29]], jnp.int32))
  q, kown, vown = (jnp.asarray(rng.normal(size=(B, n, S, D)) * 35, jnp.bfloat16)
                   for n in (HQ, HKV, HKV))
  pos = jnp.asarray(np.asarray([[40], [-1]]) + np.arange(S)[None] * np.asarray([[1], [0]]),
                    jnp.int32)
  plain = m.replay(q, kown, vown, cache, state, pos)
  jitted = jax.jit(m.replay)(q, kown, vown, cache, state, pos)
  one = lambda *a: jax.tree.map(lambda x: x[None], a)
  mapped = jax.vmap(lambda *a: jax.tree.map(lambda x: x[0], m.replay(*one(*a))))(
      q, kown, vown, cache, state, pos)
  for got in (jitted, mapped):
    for a, b in zip(jax.tree.leaves((got[0], got[2])), jax.tree.leaves((plain[0], plain[2]))):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-2, atol=1e-2)
  out = np.asarray(plain[0], np.float32)
  assert np.isfinite(out).all() and np.all(out[1] == 0)  # the padding row attends nothing
  assert np.isfinite(np.asarray(plain[2]["score"])[0, :, :40]).all()
  assert np.all(np.asarray(plain[2]["score"])[1] == 0)  # no query: nothing scored


def test_options():
  m = methods.make("kvzip", ratio=0.5)
  assert (m.n_sink, m.chunk_size, m.floor, m.head_budget.value, m.layerwise) == (
      4, 2048, 0.0, "adakv", False)
  for bad in (dict(chunk_size=0), dict(phase="both"), dict(head_budget="uniform"),
              dict(floor=0.2), dict(layerwise="no")):
    with pytest.raises(ValueError):
      methods.make("kvzip", ratio=0.5, **bad)
  assert methods.make("kvzip:layerwise=true,head_budget=uniform", ratio=0.5).layerwise
  with pytest.raises(ValueError, match="replay"):  # ThinK's composition would never replay
    methods.make("kvzip:layerwise=true,head_budget=uniform+think", ratio=0.5)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), layers=st.integers(1, 4),
                  total=st.integers(0, 200))
@hypothesis.settings(max_examples=25, deadline=None)
def test_layer_totals_count_one_ranking_over_all_layers(seed, layers, total):
  """Counts per layer of the model's top ``total`` (forced first, ties to the earlier layer,
  head and slot; empty slots never), layers of different sizes, against numpy."""
  rng = np.random.default_rng(seed)
  scores = []
  for _ in range(layers):
    s = rng.integers(0, 6, size=(B, int(rng.integers(1, 3)), int(rng.integers(1, 20))))
    s = np.where(rng.random(s.shape) < 0.1, np.inf, s.astype(np.float32))
    scores.append(np.where(rng.random(s.shape) < 0.2, -np.inf, s).astype(np.float32))
  totals = np.asarray([total, total // 3])
  got = np.stack(cross_layer.layer_totals([jnp.asarray(s) for s in scores], totals))
  for b in range(B):
    flat_scores = np.concatenate([s[b].reshape(-1) for s in scores])
    order = np.argsort(-flat_scores, kind="stable")[:totals[b]]
    order = order[flat_scores[order] > -np.inf]
    which = np.repeat(np.arange(layers), [s[b].size for s in scores])[order]
    np.testing.assert_array_equal(got[:, b], np.bincount(which, minlength=layers))


def test_traced_capacity_holds_a_layer_that_keeps_everything():
  """Under jit (the static ``decode_slots``) a model-wide ranking may put a whole prompt in one
  layer: the compacted buffer is sized for it; a per-layer budget for its own share."""
  one = methods.make("kvzip", ratio=0.5, decode_slots=0, block_size=8)
  own = methods.make("kvzip:layerwise=true", ratio=0.5, decode_slots=0, block_size=8)
  cache = one.init_cache(B, HKV, T, D)
  keep = jnp.zeros((B, HKV, T), bool)
  budget = jnp.ones((B,), jnp.int32)
  assert jax.jit(lambda c: jnp.zeros(prefill.capacity(one, c, keep, budget)))(cache).shape == (
      HKV * T,)
  assert jax.jit(lambda c: jnp.zeros(prefill.capacity(own, c, keep, budget)))(cache).shape == (
      HKV * T // 2,)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), block=st.integers(1, 7),
                  pad=st.integers(0, 3))
@hypothesis.settings(max_examples=8, deadline=None)
def test_replay_scores_do_not_depend_on_the_query_block(seed, block, pad):
  """Scoring the replay's queries a block at a time (padding the last block) gives the scores
  of all queries at once, padded replay rows included."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, kown = f(B, HQ, S, D), f(B, HKV, S, D)
  pos_ctx = np.where(np.arange(T)[None] < np.asarray(LENGTHS)[:, None], np.arange(T)[None], -1)
  pos_ctx = jnp.asarray(np.broadcast_to(pos_ctx[:, None], (B, HKV, T)), jnp.int32)
  pos = np.asarray(LENGTHS)[:, None] + np.arange(S)[None]
  pos[1, S - pad:] = -1  # the shorter row's replay padding
  args = (q, f(B, HKV, T, D), pos_ctx, kown, jnp.asarray(pos, jnp.int32),
          jnp.asarray([(0, 20), (10, 29)], jnp.int32), SINK, D ** -0.5)
  whole = kvzip.replay_scores(*args, query_block=S)
  np.testing.assert_allclose(kvzip.replay_scores(*args, query_block=block), whole,
                             rtol=1e-6, atol=1e-7)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), chunk=st.integers(1, 30),
                  starts=st.lists(st.integers(0, 40), min_size=B, max_size=B),
                  block=st.integers(1, S))
@hypothesis.settings(max_examples=20, deadline=None)
def test_replay_scores_of_the_gathered_keys_equal_every_slot(seed, chunk, starts, block):
  """``chunk`` gathers only the sinks' and the chunk's keys: the scores equal those read over
  every slot for any span no wider than ``chunk`` (a start inside the sinks, a row without a
  chunk, a chunk running past the row's last token or the cache's end)."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, kown, k_ctx = f(B, HQ, S, D), f(B, HKV, S, D), f(B, HKV, T, D)
  pos_ctx = np.where(np.arange(T)[None] < np.asarray(LENGTHS)[:, None], np.arange(T)[None], -1)
  pos_ctx = jnp.asarray(np.broadcast_to(pos_ctx[:, None], (B, HKV, T)), jnp.int32)
  pos = jnp.asarray(np.asarray(LENGTHS)[:, None] + np.arange(S)[None], jnp.int32)
  span = np.asarray([(a, min(a + chunk, n)) for a, n in zip(starts, LENGTHS)], np.int32)
  span[1] = (0, 0) if seed % 3 == 0 else span[1]  # a row with no chunk left
  args = (q, k_ctx, pos_ctx, kown, pos, jnp.asarray(span), SINK, D ** -0.5, block)
  whole = kvzip.replay_scores(*args)
  got = jax.jit(kvzip.replay_scores, static_argnums=(6, 8, 9))(*args, chunk)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(whole))
  np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-7)
  assert np.isfinite(whole).sum() == sum(max(e - a, 0) for a, e in span) * HKV
