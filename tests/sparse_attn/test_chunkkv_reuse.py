"""ChunkKV's layer-wise index reuse (Liu et al. 2025, Algorithm 2): with ``reuse_layers = N``
layer ``l`` keeps exactly the token positions that layer ``N floor(l / N)`` keeps when every layer
selects on its own (``reuse_layers = 1``), on random per-layer prompts, with a follower whose
slots hold the tokens in another order, and end to end on the tiny model."""

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from experiments.common import modelzoo
from models import decode
from sparse_attn import methods
from sparse_attn.compression import cross_layer
from tests.sparse_attn.helpers import normal

B, HQ, HKV, D, CAP = 2, 4, 2, 16, 96
LENGTHS = (90, 61)
SPEC = "chunkkv:chunk_length=4,window_size=8"


def _layer_prompts(rng, layers):
  """Per layer ``(cache, state)`` after the prompt of ``LENGTHS`` (the same positions, each
  layer its own random queries and keys)."""
  s = max(LENGTHS)
  pos = np.full((B, s), -1, np.int32)
  for i, n in enumerate(LENGTHS):
    pos[i, :n] = np.arange(n)
  m = methods.make(SPEC, ratio=0.5)
  out = []
  for _ in range(layers):
    cache, state = m.init_cache(B, HKV, CAP, D), m.init_state(B, HQ, HKV, D, CAP)
    q, k, v = (normal(rng, (B, h, s, D)) for h in (HQ, HKV, HKV))
    _, cache, state = m.prefill(q, k, v, cache, state, jnp.asarray(pos))
    out.append((cache, state))
  return out


def _permuted(cache, rng):
  """``cache`` with its first ``min(LENGTHS)`` slots (filled in every row) in a random order:
  the same tokens in other slots (the block digests, which chunkkv does not read, are left)."""
  head = min(LENGTHS)
  perm = jnp.asarray(np.r_[rng.permutation(head), head:cache.capacity])
  return dataclasses.replace(cache, **{f: jnp.take(getattr(cache, f), perm, axis=2)
                                       for f in ("k", "v", "pos")})


def _kept_positions(m, caches, states):
  """Per layer, per row, per kv head: the sorted positions ``end_prefill`` keeps."""
  states = cross_layer.apply(m, caches, states)
  kept = []
  for cache, state in zip(caches, states):
    c, _ = m.end_prefill(cache, state)
    pos, valid = np.asarray(c.pos), np.asarray(c.valid)
    kept.append([[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(HKV)]
                 for b in range(B)])
  return kept


@pytest.mark.parametrize("reuse,seed", [(2, 0), (3, 1)])
def test_followers_keep_their_leaders_positions(reuse, seed):
  rng = np.random.default_rng(seed)
  layers = _layer_prompts(rng, 5)
  caches, states = [c for c, _ in layers], [s for _, s in layers]
  own = _kept_positions(methods.make(SPEC, ratio=0.5), caches, states)
  assert own[0] != own[1]  # the layers choose differently on their own
  caches_moved = [c if i % reuse == 0 else _permuted(c, rng) for i, c in enumerate(caches)]
  m = methods.make(f"{SPEC},reuse_layers={reuse}", ratio=0.5)
  states = [m.init_state(B, HQ, HKV, D, CAP) | {k: v for k, v in s.items()} for s in states]
  got = _kept_positions(m, caches_moved, states)
  for layer, kept in enumerate(got):
    assert kept == own[layer - layer % reuse], layer
  for b, n in enumerate(LENGTHS):  # the budget: ceil(n / 2) per head
    assert all(len(h) == -(-n // 2) for h in got[1][b])


def test_without_the_pass_each_layer_selects_its_own():
  """A layer compressed alone (no ``across_layers``) falls back to its own chunks."""
  rng = np.random.default_rng(2)
  [(cache, state)] = _layer_prompts(rng, 1)
  m = methods.make(f"{SPEC},reuse_layers=2", ratio=0.5)
  state = m.init_state(B, HQ, HKV, D, CAP) | state
  alone = methods.make(SPEC, ratio=0.5)
  mine, _ = m.end_prefill(cache, state)
  theirs, _ = alone.end_prefill(cache, state)
  np.testing.assert_array_equal(np.asarray(mine.pos), np.asarray(theirs.pos))


def test_options_and_refusals():
  assert not methods.make("chunkkv", ratio=0.5).crosses_layers
  assert methods.make("chunkkv:reuse_layers=2", ratio=0.5).crosses_layers
  for bad in ("0", "1.5", "true"):
    with pytest.raises(ValueError, match="reuse_layers"):
      methods.make(f"chunkkv:reuse_layers={bad}", ratio=0.5)
  with pytest.raises(ValueError, match="chunks handed between layers"):
    methods.make("chunkkv:reuse_layers=2+think", ratio=0.5)


def test_tiny_model_second_layer_keeps_the_first_layers_tokens():
  model = modelzoo.tiny_random()
  prompts = np.random.default_rng(3).integers(10, 5000, size=(2, 96)).astype(np.int32)
  lengths = np.array([96, 70], np.int32)
  prompts = np.where(np.arange(96) < lengths[:, None], prompts, 0)

  def kept(spec):
    *_, caches, _ = decode.prefill(model, prompts, lengths, methods.make(spec, ratio=0.5), 128)
    return [np.sort(np.where(np.asarray(c.valid), np.asarray(c.pos), -1), axis=-1)
            for c in caches]

  own = kept(SPEC)
  reused = kept(f"{SPEC},reuse_layers=2")
  assert not np.array_equal(own[0], own[1])
  np.testing.assert_array_equal(reused[0], own[0])
  np.testing.assert_array_equal(reused[1], own[0])


def test_jit_and_vmap_keep_the_eager_choice():
  rng = np.random.default_rng(4)
  layers = _layer_prompts(rng, 2)
  m = methods.make(f"{SPEC},reuse_layers=2", ratio=0.5)
  caches = [c for c, _ in layers]
  states = [m.init_state(B, HQ, HKV, D, CAP) | s for _, s in layers]
  n = jnp.asarray([-(-x // 2) for x in LENGTHS], jnp.int32)

  def keeps(caches, states):
    return [m.keep_mask(c, s, None, n) for c, s in
            zip(caches, cross_layer.apply(m, caches, states))]

  eager = keeps(caches, states)
  np.testing.assert_array_equal(eager[1], eager[0])  # slots align here: the same mask
  for got in (jax.jit(keeps)(caches, states),
              jax.tree.map(lambda x: x[0], jax.vmap(keeps)(*jax.tree.map(
                  lambda x: x[None], (caches, states))))):
    for a, b in zip(got, eager):
      np.testing.assert_array_equal(a, b)
