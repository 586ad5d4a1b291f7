"""DuoAttention on the fly (arXiv 2410.10819, kvpress's on-the-fly scoring) against numpy.

The numpy side: the mean query and key rotated at every synthetic position by explicit 2x2
rotations, the last position's softmax, the mean of its cumulative sum, the group mean; the
``round(L K r)`` lowest (layer, kv head) pairs stream; a streaming head keeps its sinks and
recent tokens, a retrieval head everything, in a flat buffer of exactly the kept tokens.
"""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods, reference
from sparse_attn.compression import duo_attention, flat
from sparse_attn.compression.rope import inverse_frequencies

B, HQ, HKV, D, T, LAYERS = 2, 4, 2, 8, 48, 3
G = HQ // HKV
SINK, RECENT = 3, 5
LENGTHS = (40, 29)  # the second row padded
THETA = 100.0
TABLE = np.random.default_rng(3).normal(size=(LAYERS, HKV))


def rotate_np(x, p, inv_freq):
  """Half-split RoPE of ``x [..., D]`` at position ``p`` by explicit pair rotations."""
  half = x.shape[-1] // 2
  out = np.empty_like(x)
  for i, f in enumerate(inv_freq):
    c, s = np.cos(p * f), np.sin(p * f)
    out[..., i] = c * x[..., i] - s * x[..., i + half]
    out[..., i + half] = s * x[..., i] + c * x[..., i + half]
  return out


def scores_np(q_mean, k_mean, inv_freq, p):
  """kvpress's ``duo_attention_on_the_fly`` for one layer: ``[K]``."""
  out = np.zeros(HKV)
  for h in range(q_mean.shape[0]):
    q = rotate_np(q_mean[h], p - 1, inv_freq)
    k = np.stack([rotate_np(k_mean[h // G], i, inv_freq) for i in range(p)])
    a = k @ q / np.sqrt(q.shape[-1])
    w = np.exp(a - a.max())
    w /= w.sum()
    out[h // G] += np.cumsum(w).mean() / G
  return out


def problem(seed, dtype=jnp.float32, big=1.0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s) * big, dtype)
  pos = np.where(np.arange(T)[None] < np.asarray(LENGTHS)[:, None], np.arange(T)[None], -1)
  return f(B, HQ, T, D), f(B, HKV, T, D), f(B, HKV, T, D), jnp.asarray(pos, jnp.int32)


def prefilled(m, seed, layer=None, **kw):
  q, k, v, pos = problem(seed, **kw)
  cache = m.init_cache(B, HKV, T + 16, D)
  state = m.init_state(B, HQ, HKV, D, T + 16)
  if layer is not None:
    state = m.layer_state(state, layer)
  _, cache, state = jax.jit(m.prefill)(q, k, v, cache, state, pos)
  return cache, state, (q, k, v, pos)


def expected_keep(stream):
  """``[B, K, T]`` the pattern over a prompt at slot = position (``stream [B, K]``)."""
  keep = np.zeros((B, HKV, T), bool)
  for b, n in enumerate(LENGTHS):
    t = np.arange(n)
    window = (t < SINK) | (t >= n - RECENT)
    for h in range(HKV):
      keep[b, h, :n] = window | (not stream[b, h])
  return keep


@hypothesis.given(seed=st.integers(0, 2**31 - 1), p=st.sampled_from([1, 9, 33]),
                  theta=st.sampled_from([10.0, 1e4]))
@hypothesis.settings(max_examples=10, deadline=None)
def test_head_scores_match_numpy(seed, p, theta):
  rng = np.random.default_rng(seed)
  q, k = rng.normal(size=(HQ, D)) * 2, rng.normal(size=(HKV, D)) * 2
  inv = inverse_frequencies(D, theta)
  got = np.asarray(duo_attention.head_scores(jnp.asarray(q), jnp.asarray(k), inv, p))
  np.testing.assert_allclose(got, scores_np(q, k, inv, p), rtol=1e-5, atol=1e-6)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), ratio=st.sampled_from([0.25, 0.5, 0.75]))
@hypothesis.settings(max_examples=10, deadline=None)
def test_streaming_heads_rank_across_layers(seed, ratio):
  table = np.random.default_rng(seed).normal(size=(5, 3))
  got = duo_attention.streaming_heads(table, ratio)
  n = round(15 * ratio)
  assert got.sum() == n
  assert table[got].max(initial=-np.inf) <= table[~got].min(initial=np.inf)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), layer=st.integers(0, LAYERS - 1),
                  ratio=st.sampled_from([0.25, 0.5, 0.75]))
@hypothesis.settings(max_examples=6, deadline=None)
def test_text_table_keeps_the_pattern_in_a_flat_buffer(seed, layer, ratio):
  m = methods.make("duo_attention_on_the_fly", ratio=ratio, n_sink=SINK, recent_size=RECENT,
                   block_size=8).with_head_scores(TABLE)
  assert m.source == "text"
  cache, state, (q, k, v, pos) = prefilled(m, seed, layer)
  stream = np.broadcast_to(duo_attention.streaming_heads(TABLE, ratio)[layer], (B, HKV))
  want = expected_keep(stream)
  np.testing.assert_array_equal(np.asarray(m.prefill_keep(cache, state)[0])[..., :T], want)
  new, state = m.end_prefill(cache, state)
  assert isinstance(new, flat.FlatKVCache)
  view = flat.heads_view(new)
  for b in range(B):
    for h in range(HKV):
      kept = np.asarray(view.pos[b, h])[np.asarray(view.valid[b, h])]
      np.testing.assert_array_equal(np.sort(kept), np.flatnonzero(want[b, h]))
  # the buffer holds the kept tokens and the caller's decode room, one block of padding at most
  need = max(want[b].sum() + HKV * (T + 16 - n) for b, n in enumerate(LENGTHS))
  assert new.capacity == -(-need // 8) * 8
  # decoding attends exactly the kept prompt tokens and the new one
  rng = np.random.default_rng(seed + 1)
  dq, dk, dv = (jnp.asarray(rng.normal(size=(B, n, 1, D)), jnp.float32) for n in (HQ, HKV, HKV))
  dpos = jnp.asarray(LENGTHS, jnp.int32)[:, None]
  out, _, _ = jax.jit(m.decode)(dq, dk, dv, new, state, dpos)
  kk = jnp.concatenate([k, dk], axis=2)
  vv = jnp.concatenate([v, dv], axis=2)
  mask = np.concatenate([want, np.ones((B, HKV, 1), bool)], axis=-1)
  mask = np.repeat(mask, G, axis=1)[:, :, None]
  ref, _ = reference.attention(dq, kk, vv, jnp.asarray(mask))
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), ratio=st.sampled_from([0.5, 0.75]))
@hypothesis.settings(max_examples=5, deadline=None)
def test_prompt_fallback_is_the_prompts_own_score(seed, ratio):
  m = methods.make("duo_attention_on_the_fly", ratio=ratio, n_sink=SINK, recent_size=RECENT,
                   num_positions=30, rope_theta=THETA)
  assert m.source == "prompt"
  cache, state, (q, k, _, pos) = prefilled(m, seed)
  inv = inverse_frequencies(D, THETA)
  stream = np.zeros((B, HKV), bool)
  for b, n in enumerate(LENGTHS):
    qn, kn = np.asarray(q[b, :, :n], np.float64), np.asarray(k[b, :, :n], np.float64)
    pre_q = np.stack([rotate_np(qn[:, i], -i, inv) for i in range(n)], 1).mean(1)
    pre_k = np.stack([rotate_np(kn[:, i], -i, inv) for i in range(n)], 1).mean(1)
    s = scores_np(pre_q, pre_k, inv, 30)
    stream[b, np.argsort(s, kind="stable")[:round(HKV * ratio)]] = True
  np.testing.assert_array_equal(np.asarray(m.streaming(cache, state)), stream)
  np.testing.assert_array_equal(np.asarray(m.prefill_keep(cache, state)[0])[..., :T],
                                expected_keep(stream))


def test_jit_and_vmap_equal_the_plain_call():
  m = methods.make("duo_attention_on_the_fly", ratio=0.5, n_sink=SINK, recent_size=RECENT,
                   rope_theta=THETA)
  cache, state, _ = prefilled(m, 5)
  want = m.prefill_keep(cache, state)
  got = jax.jit(m.prefill_keep)(cache, state)
  one = lambda c, s: m.prefill_keep(jax.tree.map(lambda x: x[None], c),
                                    jax.tree.map(lambda x: x[None], s))
  unbatch = lambda t: jax.tree.map(lambda x: x[0], t)
  mapped = jax.vmap(lambda c, s: unbatch(one(c, s)))(cache, state)
  for g in (got, mapped):
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  m2 = dataclasses.replace(m, decode_slots=16)  # a static decode room: end_prefill jits
  jitted = jax.jit(m2.end_prefill)(cache, state)[0]
  plain = m.end_prefill(cache, state)[0]
  assert jitted.capacity >= plain.capacity  # sized for every head kept
  np.testing.assert_array_equal(np.sort(np.asarray(flat.heads_view(jitted).pos), -1)[..., -40:],
                                np.sort(np.asarray(flat.heads_view(plain).pos), -1)[..., -40:])


def test_bf16_large_logits_and_padding_stay_finite():
  m = methods.make("duo_attention_on_the_fly", ratio=0.5, n_sink=SINK, recent_size=RECENT,
                   rope_theta=THETA)
  cache, state, _ = prefilled(m, 7, dtype=jnp.bfloat16, big=35.0)  # |q.k| ~ 1e4
  new, state = m.end_prefill(cache, state)
  rng = np.random.default_rng(0)
  dq, dk, dv = (jnp.asarray(rng.normal(size=(B, n, 1, D)) * 35, jnp.bfloat16)
                for n in (HQ, HKV, HKV))
  out, _, _ = jax.jit(m.decode)(dq, dk, dv, new, state, jnp.asarray([[40], [-1]], jnp.int32))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)


def test_options_and_memory():
  m = methods.make("duo_attention_on_the_fly", ratio=0.5)
  assert (m.n_sink, m.recent_size, m.num_positions) == (128, 256, 500)  # kvpress's
  assert m.memory_access(4096) == pytest.approx(1 - 0.5 * (1 - 384 / 4096))
  assert hash(m.with_head_scores(TABLE)) == hash(m.with_head_scores(TABLE))
  for bad, match in ((dict(calibration="text"), "head scores"), (dict(calibration="x"), "one of"),
                     (dict(head_budget="adakv"), "head_budget"), (dict(phase="both"), "prompt"),
                     (dict(recent_size=-1), "recent_size")):
    with pytest.raises(ValueError, match=match):
      methods.make("duo_attention_on_the_fly", ratio=0.5, **bad)
  with pytest.raises(ValueError, match="layers"):
    m.with_head_scores(TABLE).layer_state(m.init_state(1, HQ, HKV, D, 8), LAYERS)
