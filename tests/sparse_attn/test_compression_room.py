"""After the prompt, every row keeps the decode room the caller allocated it.

A cache of ``T`` slots gives a row with an ``n``-token prompt ``T - n`` slots to generate into.
In a batch of ragged prompts the shorter row has more; the compacted (or channel-pruned) cache
must keep that room for every row, not only the longest one's (whose room is the least):
else the shorter row's later tokens find no slot (under jit, a write past the end is dropped).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods

B, HQ, HKV, D, T = 2, 4, 2, 8, 64
LENGTHS = (56, 20)  # room 8 and 44


def _end_of_prompt(m, seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  pos = np.tile(np.arange(T), (B, 1))
  for b, n in enumerate(LENGTHS):
    pos[b, n:] = -1
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  _, cache, state = m.prefill(f32(B, HQ, T, D), f32(B, HKV, T, D), f32(B, HKV, T, D), cache,
                              state, jnp.asarray(pos, jnp.int32))
  return m.end_prefill(cache, state)


@pytest.mark.parametrize("spec", ["knorm", "snapkv", "h2o", "knorm:head_budget=adakv",
                                  "snapkv:head_budget=adakv,floor=0"])
@pytest.mark.parametrize("ratio", [0.5, 0.875])
def test_compacted_cache_keeps_each_rows_room(spec, ratio):
  m = methods.make(spec, ratio=ratio, block_size=1)  # exact slot counts: no rounding slack
  cache, _ = _end_of_prompt(m)
  used = np.asarray(cache.length)
  for b, n in enumerate(LENGTHS):
    assert cache.capacity - used[b] >= T - n, (b, cache.capacity, used[b])
  # and not more than the fullest row needs
  assert cache.capacity == max(u + (T - n) * (HKV if m.head_rule.layout.heads(HKV) > 1 else 1)
                               for u, n in zip(used, LENGTHS))


def test_extended_row_fills_its_room_through_decode_steps():
  """The shorter row writes all of its room, one decode step at a time, and every token is
  there afterwards (none dropped)."""
  m = methods.make("knorm", ratio=0.875, block_size=1)
  cache, state = _end_of_prompt(m, seed=1)
  rng = np.random.default_rng(2)
  f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  room = T - min(LENGTHS)
  for i in range(room):
    pos = np.array([[LENGTHS[0] + i if LENGTHS[0] + i < T else -1], [LENGTHS[1] + i]], np.int32)
    _, cache, state = m.decode(f32(B, HQ, 1, D), f32(B, HKV, 1, D), f32(B, HKV, 1, D), cache,
                               state, jnp.asarray(pos))
  held = np.asarray(cache.pos)[1][np.asarray(cache.valid)[1]]
  assert set(range(LENGTHS[1], T)) <= set(held.tolist())


def test_think_decode_part_holds_each_rows_room():
  m = methods.make("think", ratio=0.5)
  cache, _ = _end_of_prompt(m)
  assert cache.prompt.capacity == max(LENGTHS)
  assert cache.recent.capacity >= T - min(LENGTHS)
