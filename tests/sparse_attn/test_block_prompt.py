"""``prompt_block``: the prompt cut block by block (kvpress's ``BlockPress``), against a numpy
transcription of kvpress's loop, with the invariants every compression method keeps."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from tests.sparse_attn import test_compression_invariants as invariants

B, HQ, HKV, D, T = 2, 4, 2, 8, 48


def numpy_score(name, k):
  """``[n]`` scores of one head's candidate keys ``k [n, D]`` (float64)."""
  if name == "knorm":
    return -np.linalg.norm(k, axis=-1)
  unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
  anchor = unit.mean(0)
  return -(unit @ anchor) / np.linalg.norm(anchor)


def numpy_block_keep(name, k, n, block, n_sink):
  """Kept token ids of one head's ``k [L, D]``: kvpress's ``BlockPress.compress`` loop (the
  first ``n`` tokens, then each block scored with them and cut back to ``n``), the sinks
  forced in as ``slot_scores`` forces them."""
  length = k.shape[0]
  kept = np.arange(min(n, length))
  for start in range(n, length, block):
    cand = np.concatenate([kept, np.arange(start, min(start + block, length))])
    score = np.where(cand < n_sink, np.inf, numpy_score(name, k[cand]))
    kept = cand[np.argsort(-score, kind="stable")[:n]]
  return np.sort(kept)


def keep_of(m, k, lengths, n):
  """``keep [B, K, T]`` of ``m`` after a prefill of keys ``k [B, K, L, D]`` (rows cut at
  ``lengths``), each row kept to ``n [B]`` tokens a head."""
  length = k.shape[2]
  pos = np.where(np.arange(length)[None] < np.asarray(lengths)[:, None], np.arange(length), -1)
  return _keep_of(m, k, jnp.asarray(pos, jnp.int32), jnp.asarray(n, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _keep_of(m, k, pos, n):
  cache = m.init_cache(B, HKV, T, D, k.dtype)
  state = m.init_state(B, HQ, HKV, D, T)
  q = jnp.zeros((B, HQ, k.shape[2], D), k.dtype)
  _, cache, state = m.prefill(q, k, k, cache, state, pos)
  return m.keep_mask(cache, state, None, n)


@hypothesis.given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(["keydiff", "knorm"]),
                  block=st.integers(1, 12), n_sink=st.integers(0, 3),
                  lengths=st.lists(st.integers(1, 40), min_size=B, max_size=B),
                  frac=st.floats(0.05, 1.0), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
@hypothesis.settings(max_examples=12, deadline=None)
def test_kept_set_equals_kvpress_loop(seed, name, block, n_sink, lengths, frac, dtype):
  """Ragged rows, any block, sinks, budgets from one token to the whole prompt."""
  m = methods.make(name, ratio=0.5, n_sink=n_sink, prompt_block=block)
  k = jnp.asarray(np.random.default_rng(seed).normal(size=(B, HKV, 40, D)), dtype)
  n = [max(1, min(n_sink, length), int(frac * length)) for length in lengths]
  keep = np.asarray(keep_of(m, k, lengths, n))
  k64 = np.asarray(k.astype(jnp.float32), np.float64)
  for b, length in enumerate(lengths):
    assert not keep[b, :, length:].any()
    for h in range(HKV):
      want = numpy_block_keep(name, k64[b, h, :length], n[b], block, n_sink)
      np.testing.assert_array_equal(np.flatnonzero(keep[b, h]), want, err_msg=f"{b}, {h}")


def test_blocks_change_keydiff_and_not_knorm():
  """KeyDiff's anchor is the candidates' mean key, so blocks change what it keeps; KNorm scores
  each key alone, so blocks keep what the one-shot cut keeps; a block as long as the prompt is
  the one-shot cut."""
  k = jnp.asarray(np.random.default_rng(0).normal(size=(B, HKV, 40, D)) + 0.5, jnp.float32)
  lengths, n = [40, 31], [12, 9]
  keep = lambda spec: np.asarray(keep_of(methods.make(spec, ratio=0.5), k, lengths, n))
  np.testing.assert_array_equal(keep("knorm:prompt_block=4"), keep("knorm"))
  np.testing.assert_array_equal(keep("keydiff:prompt_block=40"), keep("keydiff"))
  assert (keep("keydiff:prompt_block=4") != keep("keydiff")).any()


def test_prefill_decode_invariants_under_jit_and_vmap():
  """``ceil((1 - r) L)`` prompt tokens a head with the sinks, in a smaller buffer, then decode
  steps; ratio 0 keeps every token; ``end_prefill`` jitted (``decode_slots``) and vmapped over
  a batch of problems keeps what the eager call keeps."""
  p = invariants.problem(3)
  m = methods.make("keydiff", ratio=0.5, n_sink=2, prompt_block=5)
  outs, full, cache = invariants.run(m, p)
  pos, valid = np.asarray(cache.pos), np.asarray(cache.valid)
  for b, length in enumerate(invariants.LENGTHS):
    for h in range(HKV):
      prompt = pos[b, h][valid[b, h] & (pos[b, h] < length)]
      assert len(prompt) == invariants.expected_kept(length, 0.5)
      assert {0, 1} <= set(prompt.tolist())
  assert cache.capacity < full.capacity
  assert all(np.isfinite(np.asarray(o)).all() for o in outs)
  _, _, whole = invariants.run(methods.make("keydiff", ratio=0.0, prompt_block=5), p, steps=0)
  assert whole.capacity == full.capacity

  slots = invariants.T - invariants.L
  jm = methods.make("keydiff", ratio=0.5, n_sink=2, prompt_block=5, decode_slots=slots)
  d = invariants.D
  cache0 = jm.init_cache(invariants.B, HKV, invariants.T, d)
  state0 = jm.init_state(invariants.B, invariants.HQ, HKV, d, invariants.T)
  _, prompt, state = jm.prefill(p["q"], p["k"], p["v"], cache0, state0, p["pos"])
  want = jm.end_prefill(prompt, state)[0]
  got = jax.jit(jm.end_prefill)(prompt, state)[0]
  np.testing.assert_array_equal(got.pos, want.pos)
  stacked = jax.tree.map(lambda x: jnp.stack([x, x]), (prompt, state))
  vgot = jax.vmap(jm.end_prefill)(*stacked)[0]
  np.testing.assert_array_equal(vgot.pos[1], want.pos)
  np.testing.assert_array_equal(vgot.k[0], want.k)


@pytest.mark.parametrize("options,match", [
    (dict(prompt_block=-1), "prompt_block must be an int >= 0"),
    (dict(prompt_block=2.5), "prompt_block must be an int >= 0"),
    (dict(prompt_block=8, head_budget="adakv"), "head_budget='uniform'"),
])
def test_bad_options_raise(options, match):
  with pytest.raises(ValueError, match=match):
    methods.make("keydiff", ratio=0.5, **options)


def test_only_scorers_of_keys_alone_take_it():
  """A scorer whose state records the whole prompt's queries (SnapKV) has no block option."""
  with pytest.raises(ValueError, match="unknown option"):
    methods.make("snapkv", ratio=0.5, prompt_block=8)
