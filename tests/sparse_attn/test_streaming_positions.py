"""StreamingLLM's position modes: ``"original"`` (default) and the paper's ``"rolling"``
cache-relative positions (Xiao et al. 2024, Sec. 3.2), checked against a numpy reference that
rotates the pre-RoPE keys at their cache indices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression.rope import inverse_frequencies, rotate_by
from tests.sparse_attn import helpers

B, HQ, HKV, D, P, THETA = 1, 4, 2, 16, 40, 100.0


def _rope(x, pos):
  """Rotate ``x [B, H, S, D]`` at ``pos [S]`` (the model's RoPE, same convention)."""
  off = jnp.broadcast_to(jnp.asarray(pos)[None, None], x.shape[:3])
  return rotate_by(x, off, inverse_frequencies(D, THETA))


def _run(m, rng):
  """Prefill P tokens (evicting half at the end), then decode one at position P."""
  mk = lambda *s: helpers.normal(rng, s)
  q0, k0, v = mk(B, HQ, P, D), mk(B, HKV, P, D), mk(B, HKV, P, D)
  pos = jnp.arange(P, dtype=jnp.int32)[None]
  cache = m.init_cache(B, HKV, m.round_capacity(P + 4), D)
  state = m.init_state(B, HQ, HKV, D, cache.capacity)
  _, cache, state = m.prefill(_rope(q0, np.arange(P)), _rope(k0, np.arange(P)), v, cache, state,
                              pos)
  cache, state = m.end_prefill(cache, state)
  qn0, kn0, vn = mk(B, HQ, 1, D), mk(B, HKV, 1, D), mk(B, HKV, 1, D)
  out, cache, _ = jax.jit(m.decode)(_rope(qn0, [P]), _rope(kn0, [P]), vn, cache, state,
                                    jnp.asarray([[P]], jnp.int32))
  return out, cache, dict(k0=np.concatenate([k0, kn0], 2), v=np.concatenate([v, vn], 2),
                          q0=qn0)


def _reference(raw, cache, rolling):
  """numpy attention over the kept keys, at cache indices (rolling) or original positions."""
  out = np.zeros((B, HQ, D))
  kept = np.asarray(cache.pos)
  for h in range(HQ):
    kh = h // (HQ // HKV)
    p = np.sort(kept[0, kh][kept[0, kh] >= 0])
    at = np.arange(len(p)) if rolling else p
    k = np.asarray(_rope(jnp.asarray(raw["k0"][:, kh:kh + 1, p]), at))[0, 0]
    q = np.asarray(_rope(jnp.asarray(raw["q0"][:, h:h + 1]), [at[-1]]))[0, 0, 0]
    s = k @ q / np.sqrt(D)
    w = np.exp(s - s.max())
    out[0, h] = w @ raw["v"][0, kh, p] / w.sum()
  return out


@pytest.mark.parametrize("mode", ["original", "rolling"])
def test_decode_after_eviction_matches_reference(mode):
  m = methods.make("streaming_llm", ratio=0.5, positions=mode, rope_theta=THETA)
  out, cache, raw = _run(m, np.random.default_rng(0))
  assert int(np.sum(np.asarray(cache.valid)[0, 0])) < P  # really evicted
  np.testing.assert_allclose(out[:, :, 0], _reference(raw, cache, mode == "rolling"),
                             atol=2e-5, rtol=2e-5)


def test_rolling_differs_from_original_after_eviction_and_equals_it_without():
  outs = {}
  for ratio in (0.0, 0.5):
    for mode in ("original", "rolling"):
      m = methods.make("streaming_llm", ratio=ratio, positions=mode, rope_theta=THETA)
      outs[ratio, mode] = _run(m, np.random.default_rng(1))[0]
  np.testing.assert_allclose(outs[0.0, "rolling"], outs[0.0, "original"], atol=2e-5)
  assert not np.allclose(outs[0.5, "rolling"], outs[0.5, "original"], atol=1e-3)


def test_default_is_original_and_rolling_needs_rope():
  assert methods.make("streaming_llm").positions == "original"
  with pytest.raises(ValueError, match="positions must be one of"):
    methods.make("streaming_llm", positions="relative")
  m = methods.make("streaming_llm", ratio=0.5, positions="rolling")
  with pytest.raises(ValueError, match="rope_theta or rope_inv_freq"):
    _run(m, np.random.default_rng(2))


def test_rolling_positions_need_per_head_caches():
  with pytest.raises(ValueError, match="head_budget='uniform'"):
    methods.make("streaming_llm", ratio=0.5, positions="rolling", head_budget="adakv",
                 rope_theta=1e4)
