"""Adaptive block budgets: top-p and Ada-KV allocation vs brute force."""

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from sparse_attn import adaptive, kernels
from sparse_attn.budget import Budget
from tests.sparse_attn import helpers


def _np_mass(scores, length, bs, scale):
  nb = len(scores)
  size = np.clip(length - np.arange(nb) * bs, 0, bs)
  lg = np.where(size > 0, scale * scores + np.log(np.maximum(size, 1)), -np.inf)
  p = np.exp(lg - lg.max())
  return p / p.sum()


def _problem(seed, bs=8, t=128, lengths=(128, 51)):
  rng = np.random.default_rng(seed)
  c = helpers.filled_cache(rng, 2, 2, t, 8, list(lengths), block_size=bs, scale=2.0)
  q = helpers.normal(rng, (2, 4, 8), scale=2.0)
  return c, kernels.quest_scores(q, c, impl="xla")


@given(seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([0.3, 0.7, 0.9, 1.0]),
       n_sink=st.sampled_from([0, 4]))
def test_topp_is_smallest_prefix_reaching_tau(seed, tau, n_sink):
  c, scores = _problem(seed)
  bud = Budget(budget=1.0, n_sink=n_sink, local_window=0)
  sel = adaptive.topp(scores, c, bud, tau)
  for i, ln in enumerate((128, 51)):
    for h in range(4):
      mass = _np_mass(np.asarray(scores[i, h], np.float64), ln, 8, 1 / np.sqrt(8))
      got = [int(x) for x in sel.idx[i, h, :int(sel.n_valid[i, h])]]
      assert len(set(got)) == len(got) and all(x * 8 < ln for x in got)
      forced = [n for n in range(16) if n * 8 < n_sink and n * 8 < ln]
      assert set(forced) <= set(got)
      rest = sorted((n for n in range(16) if n * 8 < ln and n not in forced),
                    key=lambda n: -mass[n])
      # brute force: forced, then the fewest by mass until tau is reached
      want, acc = list(forced), mass[forced].sum()
      for n in rest:
        if acc >= tau * (1 - 1e-6):
          break
        want.append(n); acc += mass[n]
      assert set(got) == set(want)


@given(seed=st.integers(0, 2**31 - 1), frac=st.sampled_from([0.1, 0.25]),
       floor=st.sampled_from([0.0, 0.2, 1.0]))
def test_adakv_spends_layer_budget_on_largest_masses(seed, frac, floor):
  c, scores = _problem(seed, t=256, lengths=(256, 200))
  bud = Budget(budget=frac, n_sink=0, local_window=0)
  sel = adaptive.adakv(scores, c, bud, floor=floor)
  for i, ln in enumerate((256, 200)):
    n_u = int(np.ceil(frac * ln / 8))
    counts = np.asarray(sel.n_valid[i])
    assert counts.sum() == 4 * n_u  # the layer total, redistributed
    assert counts.min() >= int(np.ceil(floor * n_u))
    if floor == 1.0:
      assert (counts == n_u).all()  # the uniform ablation
    masses = [_np_mass(np.asarray(scores[i, h], np.float64), ln, 8, 1 / np.sqrt(8))
              for h in range(4)]
    chosen = [masses[h][np.asarray(sel.idx[i, h, :counts[h]])] for h in range(4)]
    left = [np.delete(masses[h][:-(-ln // 8)], np.asarray(sel.idx[i, h, :counts[h]]))
            for h in range(4)]
    # beyond the floors, no unchosen block outweighs a chosen one
    extra = [ch[int(np.ceil(floor * n_u)):] for ch in chosen]
    lo = min((e.min() for e in extra if len(e)), default=np.inf)
    hi = max((lf.max() for lf in left if len(lf)), default=-np.inf)
    assert lo >= hi - 1e-6


@pytest.mark.parametrize("floor", [0.2, 0.5, 1.0])
def test_adakv_floor_keeps_a_starved_head(floor):
  """One flat head against three whose masses sit on 6 blocks each (18 blocks wanted of the
  layer's 4 x 4): the layer-wide ranking alone gives the flat head nothing; Ada-KV's floor
  (Feng et al. 2024, Sec. 4.3) gives it exactly ``ceil(floor * n)`` blocks."""
  rng = np.random.default_rng(0)
  c = helpers.filled_cache(rng, 1, 2, 256, 8, [256], block_size=8)
  scores = np.zeros((1, 4, 32), np.float32)
  scores[0, 1:, :6] = 40.0
  sel = adaptive.adakv(jax.numpy.asarray(scores), c, Budget(budget=0.1, n_sink=0, local_window=0),
                       floor=floor)
  n_u = int(np.ceil(0.1 * 256 / 8))  # 4 blocks per head, 16 in the layer
  counts = np.asarray(sel.n_valid[0])
  assert counts.sum() == 4 * n_u
  assert counts[0] == int(np.ceil(floor * n_u))


def test_adaptive_jit_and_bad_options():
  c, scores = _problem(0)
  bud = Budget(budget=0.25)
  a = adaptive.topp(scores, c, bud, 0.8)
  b = jax.jit(adaptive.topp, static_argnums=(2, 3))(scores, c, bud, 0.8)
  np.testing.assert_array_equal(a.n_valid, b.n_valid)
  with pytest.raises(ValueError, match="topp"):
    adaptive.topp(scores, c, bud, 1.5)
  with pytest.raises(ValueError, match="floor"):
    adaptive.adakv(scores, c, bud, floor=2.0)
