"""Expected Attention's RoPE handling on Qwen2's RoPE (Devoto et al. 2025, Eq. 5-6).

Qwen2 (Qwen2.5-Coder-0.5B): head dim 64, ``rope_theta = 1e6``, Hugging Face's half-split
``rotate_half`` layout (channel ``i`` pairs with ``i + 32``). The "rotated Qwen2 query" is built
here independently, in float64, from the Hugging Face formula ``q cos + rotate_half(q) sin`` (and
once from ``transformers``' own Qwen2 code); the method must (1) un-rotate it back to the
pre-RoPE query with its own inverse RoPE (``observe``) and (2) give, as its expected query
``mu_bar = R_bar mu``, the brute-force average of ``mu`` explicitly rotated to each of the next
512 positions. float32 angles ``p * w`` carry a relative error of a few 1e-8, so the tolerances
grow with the position (``5e-8 p`` of the query's size; ~1e-8 p is measured).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import rope as model_rope
from models.config import RopeConfig
from sparse_attn import methods
from tests import isolated

D, THETA, N_FUTURE = 64, 1e6, 512
HQ, HKV, S = 2, 1, 32
POSITIONS = (0, 1, 2, 31, 511, 4095, 8191, 16383, 32767)  # Qwen2.5: 32k positions


def hf_inv_freq():
  """float64 ``theta^(-2i/D)``, the Qwen2 rotary frequencies."""
  return 1.0 / THETA ** (np.arange(0, D, 2, dtype=np.float64) / D)


def hf_rotate(x, pos):
  """Qwen2's RoPE in float64: ``x cos + rotate_half(x) sin``, ``cos = cat(cos(p w), cos(p w))``.

  ``x [..., S, D]`` at ``pos [S]``."""
  ang = np.asarray(pos, np.float64)[:, None] * hf_inv_freq()  # [S, D/2]
  cos, sin = np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)
  half = D // 2
  rot_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rot_half * sin


def _method(source, **kw):
  """EA with Qwen2's RoPE given as ``rope_theta`` or as the model's frequencies (what the
  experiments pass, ``modelzoo.rope_inv_freq`` -> ``with_rope``)."""
  if source == "theta":
    return methods.make("expected_attention", ratio=0.5, n_sink=0, rope_theta=THETA, **kw)
  m = methods.make("expected_attention", ratio=0.5, n_sink=0, **kw)
  return m.with_rope(model_rope.inverse_frequencies(RopeConfig(theta=THETA), D))


def _unrotated_by_observe(m, qpost, pos):
  """The pre-RoPE queries ``[HQ, S, D]`` the method records from post-RoPE ``qpost``."""
  state = m.init_state(1, HQ, HKV, D, 16)
  q = jnp.asarray(qpost, jnp.float32)[None]
  positions = jnp.asarray(pos, jnp.int32)[None]
  state = jax.jit(lambda q, st, p: m.observe(q, None, st, p, None, 1 / math.sqrt(D)))(
      q, state, positions)
  ring = state["queries"]
  slot = {int(p): i for i, p in enumerate(np.asarray(ring["pos"][0])) if p >= 0}
  return np.stack([np.asarray(ring["buf"][0, slot[int(p)]]) for p in pos], 1)  # [HQ, S, D]


def _assert_close_by_position(got, want, pos, per_pos=5e-8, floor=1e-6):
  size = np.abs(want).max()
  err = np.abs(got - want).max(axis=(0, 2))  # [S]
  bound = size * (floor + per_pos * np.asarray(pos, np.float64))
  assert np.all(err <= bound), list(zip(pos, err / size))


@pytest.mark.parametrize("source", ["theta", "model"])
def test_unrotating_a_rotated_qwen2_query_gives_the_pre_rope_query(source):
  m = _method(source, prefill_stats="window", n_queries=len(POSITIONS))
  qpre = np.random.default_rng(0).normal(size=(HQ, len(POSITIONS), D)) * 4.0
  back = _unrotated_by_observe(m, hf_rotate(qpre, POSITIONS), POSITIONS)
  _assert_close_by_position(back, qpre, POSITIONS)
  # A wrong layout (interleaved pairs) or theta would miss by O(1) from position 1 on.
  assert np.abs(back - qpre)[:, 1].max() < 1e-5 * np.abs(qpre).max()


def _transformers_qwen2_rotation(qpre, positions):
  """``transformers``' own Qwen2 RoPE of ``qpre [1, H, S, D]`` (run in a child process)."""
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import Qwen2Config  # pylint: disable=g-import-not-at-top
  from transformers.models.qwen2 import modeling_qwen2  # pylint: disable=g-import-not-at-top
  cfg = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                    rope_theta=THETA, max_position_embeddings=32768)
  x = torch.from_numpy(qpre)
  cos, sin = modeling_qwen2.Qwen2RotaryEmbedding(cfg)(x, torch.tensor([list(positions)]))
  return modeling_qwen2.apply_rotary_pos_emb(x, x, cos, sin)[0].numpy()


def test_unrotating_transformers_qwen2_rope():
  """The same, with the rotation from ``transformers``' Qwen2 code itself."""
  pytest.importorskip("transformers")
  qpre = np.random.default_rng(1).normal(size=(1, HQ, len(POSITIONS), D)).astype(np.float32) * 4
  qpost = isolated.reference(_transformers_qwen2_rotation, qpre, POSITIONS, timeout=300)
  back = _unrotated_by_observe(_method("theta", prefill_stats="window",
                                       n_queries=len(POSITIONS)), qpost[0], POSITIONS)
  # transformers rotates in float32 too: twice the angle error.
  _assert_close_by_position(back, qpre[0], POSITIONS, per_pos=1e-7)


@pytest.mark.parametrize("source", ["theta", "model"])
@pytest.mark.parametrize("next_pos", [S, 8192])
def test_expected_query_is_the_brute_force_future_average(source, next_pos):
  """Eq. 5-6: ``mu_bar = R_bar mu``, ``R_bar = 1/512 sum_{j=1}^{512} R_{t+j}`` (t the last
  prompt position), against ``mu`` rotated explicitly to each of those 512 positions."""
  m = _method(source)  # prefill statistics from every prompt query (the paper's protocol)
  rng = np.random.default_rng(2)
  pos = np.arange(next_pos - S, next_pos)
  qpre = rng.normal(size=(HQ, S, D)) + 3.0 * rng.normal(size=(HQ, 1, D))
  cache = m.init_cache(1, HKV, next_pos, D)
  state = m.init_state(1, HQ, HKV, D, next_pos)
  f32 = lambda x: jnp.asarray(x, jnp.float32)[None]
  kv = f32(rng.normal(size=(HKV, S, D)))
  _, cache, state = jax.jit(m.prefill)(f32(hf_rotate(qpre, pos)), kv, kv, cache, state,
                                       jnp.asarray(pos, jnp.int32)[None])
  assert int(state["next_pos"][0]) == next_pos
  mu_bar, cov_bar = (np.asarray(x[0], np.float64) for x in m.statistics(state, D))

  t = next_pos - 1
  future = np.arange(t + 1, t + N_FUTURE + 1)  # the next 512 positions
  mu = qpre.mean(1)  # [HQ, D] pre-RoPE mean
  want_mu = np.stack([hf_rotate(np.repeat(mu[h][None], N_FUTURE, 0), future).mean(0)
                      for h in range(HQ)])
  # Rotated covariance (Eq. 6): R_bar Sigma R_bar^T, R_bar from explicit rotations.
  r_bar = hf_rotate(np.repeat(np.eye(D)[:, None], N_FUTURE, 1), future).mean(1).T  # [D, D]
  xc = qpre - mu[:, None]
  cov = np.einsum("hsd,hse->hde", xc, xc) / S
  want_cov = np.einsum("de,hef,gf->hdg", r_bar, cov, r_bar)
  tol = 5e-8 * (t + N_FUTURE) + 1e-6  # float32 angles, see the module docstring
  np.testing.assert_allclose(mu_bar, want_mu, atol=tol * np.abs(mu).max())
  np.testing.assert_allclose(cov_bar, want_cov, atol=tol * np.abs(cov).max())
  # The average is not the rotation to any single position (a real test of the mean).
  one = hf_rotate(mu, np.full(1, t + 1))
  assert np.abs(one - want_mu).max() > 0.1 * np.abs(mu).max()
