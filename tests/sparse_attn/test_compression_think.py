"""ThinK (key-channel pruning): channel scores against numpy, the pruned cache really holds
``D' = ceil((1 - r) D)`` key channels, and attention over it equals masked dense attention."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import catalog, methods
from sparse_attn.compression import think

B, HQ, HKV, D, L, T, W = 2, 4, 2, 16, 40, 64, 8
LENGTHS = (40, 29)
STEPS = 2


def problem(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.normal(size=s) * (1 + np.arange(s[-1]) % 5), dtype)
  pos = np.tile(np.arange(L), (B, 1))
  for i, n in enumerate(LENGTHS):
    pos[i, n:] = -1
  return dict(q=f(B, HQ, L, D), k=f(B, HKV, L, D), v=f(B, HKV, L, D), pos=jnp.asarray(pos),
              dq=f(STEPS, B, HQ, 2, D), dk=f(STEPS, B, HKV, 2, D), dv=f(STEPS, B, HKV, 2, D))


def prefill(m, p):
  cache = m.init_cache(B, HKV, T, D, dtype=p["k"].dtype)
  state = m.init_state(B, HQ, HKV, D, T)
  _, cache, state = jax.jit(m.prefill)(p["q"], p["k"], p["v"], cache, state, p["pos"])
  return cache, state


def run(m, p, chunk=1, end=None, step=None):
  """prefill -> end_prefill -> ``STEPS`` decode steps (``chunk=2``: ``extend`` by 2 tokens)."""
  cache, state = prefill(m, p)
  cache, state = (end or m.end_prefill)(cache, state)
  outs, at = [], jnp.asarray(LENGTHS)[:, None]
  call = step or jax.jit(m.decode if chunk == 1 else m.extend)
  for i in range(STEPS):
    positions = at + jnp.arange(chunk)
    sl = slice(0, chunk)
    o, cache, state = call(p["dq"][i][:, :, sl], p["dk"][i][:, :, sl], p["dv"][i][:, :, sl],
                           cache, state, positions)
    outs.append(np.asarray(o, np.float32))
    at = at + chunk
  return outs, cache


def numpy_channels(p, ratio):
  """Brute force: ``[B, K, D']`` kept channels by ``mean_{g,w} q^2 * mean_t k^2``."""
  q, k = np.asarray(p["q"], np.float64), np.asarray(p["k"], np.float64)
  kept = -(-(D * (1 - ratio) - 1e-9) // 1)
  out = np.zeros((B, HKV, int(kept)), np.int64)
  for b, n in enumerate(LENGTHS):
    for h in range(HKV):
      qw = q[b, h * (HQ // HKV):(h + 1) * (HQ // HKV), n - W:n]  # [G, W, D]
      s = (qw ** 2).mean(axis=(0, 1)) * (k[b, h, :n] ** 2).mean(axis=0)
      out[b, h] = np.sort(np.argsort(-s, kind="stable")[:int(kept)])
  return out


def numpy_reference(p, channels, chunk=1, recent=0):
  """Softmax attention of each decode query over the prompt keys with the pruned channels
  zeroed (the masked computation; the last ``recent`` prompt keys and the generated keys
  whole), at scale 1/sqrt(D)."""
  f = lambda x: np.asarray(x, np.float64)
  outs = []
  for b, n in enumerate(LENGTHS):
    mask = np.ones((HKV, n, D))
    for h in range(HKV):
      cut = np.zeros(D)
      cut[channels[b, h]] = 1
      mask[h, :max(n - recent, 0)] = cut
    keys = [f(p["k"])[b, :, :n] * mask]
    vals = [f(p["v"])[b, :, :n]]
    row = []
    for i in range(STEPS):
      keys.append(f(p["dk"][i])[b, :, :chunk])
      vals.append(f(p["dv"][i])[b, :, :chunk])
      kk, vv = np.concatenate(keys, 1), np.concatenate(vals, 1)
      q = f(p["dq"][i])[b, :, :chunk]  # [N, S, D]
      o = np.zeros((HQ, chunk, D))
      for hq in range(HQ):
        h = hq // (HQ // HKV)
        for s in range(chunk):
          vis = kk.shape[1] - chunk + s + 1  # causal within the chunk
          logit = kk[h, :vis] @ q[hq, s] / np.sqrt(D)
          w = np.exp(logit - logit.max())
          o[hq, s] = w @ vv[h, :vis] / w.sum()
      row.append(o)
    outs.append(row)
  return [np.stack([outs[b][i] for b in range(B)]) for i in range(STEPS)]


@pytest.mark.parametrize("ratio", [0.5, 0.3])
def test_channel_scores_and_pruned_attention_against_numpy(ratio):
  m = methods.make("think", ratio=ratio, window_size=W)
  p = problem(1)
  want = numpy_channels(p, ratio)
  assert m.kept_dim(D) == want.shape[-1] == D - int(D * ratio)  # kvpress's n_pruned
  outs, cache = run(m, p)
  np.testing.assert_array_equal(cache.channels, want)
  for got, ref in zip(outs, numpy_reference(p, want)):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("recent", [5, 33])  # 33: every key of the 29-token row whole
def test_recent_prompt_keys_stay_whole_as_the_authors_code(recent):
  """``recent_size``: the channels are scored over every prompt key (unchanged); each row's
  last ``recent`` prompt keys stay whole, the rest pruned (the authors' key_pruner)."""
  m = methods.make("think", ratio=0.5, window_size=W, recent_size=recent)
  p = problem(7)
  want = numpy_channels(p, 0.5)
  for chunk in (1, 2):
    outs, cache = run(m, p, chunk=chunk)
    np.testing.assert_array_equal(cache.channels, want)
    for got, ref in zip(outs, numpy_reference(p, want, chunk=chunk, recent=recent)):
      np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
  assert cache.prompt.k.shape[2] == max(LENGTHS) - recent  # no slot for the whole keys
  np.testing.assert_array_equal(cache.prompt.length, np.maximum(np.asarray(LENGTHS) - recent, 0))
  assert m.memory_access(40) == pytest.approx(1 - 0.25 * (40 - recent) / 40)
  jitted, _ = run(dataclasses.replace(m, decode_slots=T - L), p,
                  end=jax.jit(dataclasses.replace(m, decode_slots=T - L).end_prefill))
  for a, b in zip(jitted, run(m, p)[0]):  # other buffer sizes: another summation order
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_extend_chunk_equals_masked_dense():
  m = methods.make("think", ratio=0.5, window_size=W)
  p = problem(2)
  outs, _ = run(m, p, chunk=2)
  for got, ref in zip(outs, numpy_reference(p, numpy_channels(p, 0.5), chunk=2)):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_key_buffer_really_has_the_kept_channels():
  m = methods.make("think", ratio=0.75, window_size=W)
  p = problem(3)
  cache, state = prefill(m, p)
  dense_bytes = cache.nbytes()
  new, _ = m.end_prefill(cache, state)
  dk = m.kept_dim(D)
  assert dk == 4 and new.prompt.k.shape == (B, HKV, max(LENGTHS), dk)
  assert new.prompt.k.nbytes == B * HKV * max(LENGTHS) * dk * 4  # the pruned keys' bytes
  assert new.prompt.v.shape == (B, HKV, max(LENGTHS), D)
  room = T - min(LENGTHS)  # the most decode room the caller gave a row (the shortest's)
  assert new.recent.k.shape == (B, HKV, room, D)
  kv = lambda c: c.k.nbytes + c.v.nbytes
  assert kv(new.prompt) + kv(new.recent) == B * HKV * (max(LENGTHS) * (dk + D) + room * 2 * D) * 4
  assert new.nbytes() < dense_bytes and new.channels.shape == (B, HKV, dk)
  want_valid = np.asarray(cache.valid)[..., :max(LENGTHS)]
  np.testing.assert_array_equal(new.valid, np.concatenate(
      [want_valid, np.zeros((B, HKV, room), bool)], axis=-1))
  assert m.memory_access() == 1 - 0.75 / 2


def test_ratio_zero_is_dense():
  p = problem(4)
  m = methods.make("think", ratio=0.0)
  outs, cache = run(m, p)
  assert type(cache).__name__ == "KVCache"
  for got, ref in zip(outs, numpy_reference(p, np.tile(np.arange(D), (B, HKV, 1)))):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_jit_and_vmap_equal_the_plain_call():
  m = methods.make("think", ratio=0.5, window_size=W, decode_slots=T - L)
  p = problem(5)
  eager, _ = run(m, p)
  jitted, _ = run(m, p, end=jax.jit(m.end_prefill))  # traced lengths: sized by decode_slots
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
  cache, state = prefill(m, p)
  cache, state = m.end_prefill(cache, state)
  args = (p["dq"][0][:, :, :1], p["dk"][0][:, :, :1], p["dv"][0][:, :, :1], cache, state)
  plain, _, _ = m.decode(*args, jnp.asarray(LENGTHS)[:, None])
  np.testing.assert_allclose(plain, eager[0], atol=1e-6, rtol=1e-6)
  # vmap over batch: each row alone, as a batch of one
  one = lambda x: jax.tree_util.tree_map(lambda a: a[:, None], x)
  o, _, _ = jax.vmap(m.decode)(*map(one, args), jnp.asarray(LENGTHS)[:, None, None])
  np.testing.assert_allclose(o[:, 0], plain, atol=1e-6, rtol=1e-6)


def test_bf16_large_logits_stay_finite():
  p = problem(6, jnp.bfloat16)
  p = dict(p, dq=p["dq"] * 300, k=p["k"] * 30)  # |q.k| ~ 1e4
  outs, cache = run(methods.make("think", ratio=0.5, window_size=W), p)
  assert cache.prompt.k.dtype == jnp.bfloat16 and cache.prompt.k.shape[-1] == D // 2
  assert all(np.isfinite(o).all() for o in outs)
  ref = numpy_reference(p, np.asarray(cache.channels))
  for got, want in zip(outs, ref):
    np.testing.assert_allclose(got, want, atol=0.1, rtol=0.05)


def test_spec_options_and_catalog():
  m = methods.make("think:ratio=0.25,window_size=16")
  assert (m.ratio, m.window_size) == (0.25, 16) and methods.make("think", budget=0.5).ratio == 0.5
  assert "think" in {i.name for i in catalog.available("compression")}
  for bad in (dict(head_budget="adakv"), dict(phase="both"), dict(window_size=0),
              dict(recent_size=-1)):
    with pytest.raises(ValueError):
      methods.make("think", ratio=0.5, **bad)
  assert dataclasses.replace(m, ratio=0.5).kept_dim(64) == 32
