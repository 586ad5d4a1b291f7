"""The shared prefill of ``experiments.tasks.decoding`` equals each method's own prefill."""

import jax
import numpy as np

from experiments.common import modelzoo
from experiments.tasks import decoding
from models import decode
from sparse_attn import methods

SPECS = ["dense", "quest", "quest+resa", "quest+retro:w=2", "quest+resa+retro:w=2",
         "quest+resa:typical_query=last", "quest+retro:w=4", "quest:gqa=group+retro:w=2",
         "quest+rect:f=4", "streaming", "snapkv:ratio=0.5"]


def test_shared_prefill_equals_own_prefill():
  model = modelzoo.tiny_random()
  rng = np.random.default_rng(0)
  lengths = np.array([70, 53], np.int32)
  prompts = rng.integers(10, 1000, (2, 70)).astype(np.int32)
  prompts[1, 53:] = 0
  ms = [methods.make(s, budget=0.25) if s not in ("dense",) and "snapkv" not in s
        else methods.make(s) for s in SPECS]
  shared = dict(decoding.prefill_all(model, prompts, lengths, ms, capacity=96))
  assert set(shared) == set(ms)
  for m in ms:
    got = shared[m]
    want = decode.prefill(model, prompts, lengths, m, m.round_capacity(96), 512)
    assert got.capacity == m.round_capacity(96)
    for g, w in zip((got.last, got.history, got.caches, got.states), want):
      assert jax.tree.structure(g) == jax.tree.structure(w), m.spec
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   atol=1e-5, err_msg=m.spec)
  union = decoding._prefill_union([m for m in ms if isinstance(m, methods.Method)])
  assert union.resa and union.window == 2
  # typical_query=last and w=4 differ from the union and take their own prefill
  assert not decoding._shares_union(ms[5], union)
  assert not decoding._shares_union(ms[6], union)
  assert decoding._shares_union(ms[4], union)
