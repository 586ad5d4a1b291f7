"""What the harness records for CriticalKV / CriticalAdaKV (issue 52): the kept tokens per kv
head (``experiments.tasks.accuracy.kv_kept``, measured from the compacted cache after
``end_prefill``) equal the size of the brute-force kept set, and the compacted cache holds that
set: Feng et al. 2025's two stages (Alg. 1: the top ``floor(f n)`` by SnapKV's votes, the rest
by ``(s + eps) ||v W^O_h||_1``) split the budget ``n = ceil((1 - r) L)`` without adding or
dropping a token, per head (uniform) or per Ada-KV share (CriticalAdaKV). Compression methods
report no ``attended_tokens`` (no ``Budget.accounting``): the kept count is measured."""

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.tasks import accuracy
from sparse_attn import methods
from sparse_attn.compression import criticalkv, flat
from tests.sparse_attn.test_compression_baselines import (B, D, HKV, HQ, LENGTHS, N_SINK, T,
                                                          WINDOW, check_kept, make_problem,
                                                          numpy_scores)
from tests.sparse_attn.test_compression_snapkv_family import (f32, numpy_norm, numpy_two_stage,
                                                              out_proj)

RATIO = 0.5


def _compacted(m, p, wo):
  """The cache ``end_prefill`` leaves after a prefill of problem ``p`` with ``W^O = wo``."""
  cache, state = m.init_cache(B, HKV, T, D), m.init_state(B, HQ, HKV, D, T)
  state = criticalkv.set_out_proj(state, f32(wo))
  _, cache, state = m.prefill(f32(p["q"]), f32(p["k"]), f32(p["v"]), cache, state,
                              jnp.asarray(p["pos"]))
  return m.end_prefill(cache, state)[0]


def _kept_positions(cache):
  """``[B, K, T]`` bool: the token positions each kv head holds, either layout."""
  keep = np.zeros((B, HKV, T), bool)
  pos = np.asarray(cache.pos)
  if isinstance(cache, flat.FlatKVCache):
    head = np.asarray(cache.head)
    for b, t in zip(*np.nonzero(pos >= 0)):
      keep[b, head[b, t], pos[b, t]] = True
  else:
    for b, h, t in zip(*np.nonzero(pos >= 0)):
      keep[b, h, pos[b, h, t]] = True
  return keep


def _np_kept(p, b, n, wo, adakv):
  """Brute force of row ``b`` -> (``[HKV, n]`` two-stage scores, kept count per head)."""
  kept = math.ceil((1 - RATIO) * n)
  raw = np.where(np.arange(n) < N_SINK, np.inf, numpy_scores("snapkv", p, b, n, 0) / WINDOW)
  share = np.full(HKV, kept)
  if adakv:  # Ada-KV's per-head counts from SnapKV's scores: floor 0.2, then layer-wide
    tier = np.zeros(raw.shape, bool)
    for h in range(HKV):
      tier[h, np.argsort(-raw[h], kind="stable")[:int(0.2 * kept)]] = True
    flat_scores = np.where(tier, np.inf, raw).ravel()
    top = np.argsort(-flat_scores, kind="stable")[:HKV * kept]
    share = np.bincount(top // n, minlength=HKV)
  score = numpy_two_stage(raw, numpy_norm(p, b, n, wo), (share * 0.5).astype(int))
  return score, share


@pytest.mark.parametrize("spec", ["criticalkv", "criticaladakv"])
def test_recorded_kept_tokens_equal_the_brute_force_kept_set(spec):
  m = methods.make(spec, ratio=RATIO, n_sink=N_SINK, window_size=WINDOW)
  assert m.attended_tokens(max(LENGTHS)) is None  # measured, not predicted
  for seed in (3, 11):
    p, wo = make_problem(seed), out_proj(seed % 7)
    cache = _compacted(m, p, wo)
    recorded = accuracy.kv_kept(types.SimpleNamespace(caches=[cache]))
    keep = _kept_positions(cache)
    for b, n in enumerate(LENGTHS):
      score, share = _np_kept(p, b, n, wo, spec == "criticaladakv")
      assert recorded[b] == pytest.approx(share.mean())  # the harness's kv_kept
      assert share.sum() == HKV * math.ceil((1 - RATIO) * n)  # the budget, not more or less
      np.testing.assert_array_equal(keep[b, :, :n].sum(-1), share)
      assert not keep[b, :, n:].any()
      for h in range(HKV):  # the kept set itself (near-ties at the cut may differ)
        check_kept(keep[b, h:h + 1, :n], score[h:h + 1], share[h])
