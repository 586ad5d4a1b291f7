"""FINCH's key re-rotation (kvpress's ``FinchPress(rerotate_keys=True)``, its default).

The reference is kvpress's arithmetic in numpy, from the pre-RoPE keys: each kv head's kept
prompt keys rotated at ``0 .. n-1``, the decoded tokens (queries and keys) at ``n, n+1, ...``,
exact softmax attention. Ours keeps the tokens' positions and re-rotates the kept keys to end
just before the next token; the distances, hence the outputs, are the same.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, rope as model_rope
from models.config import ModelConfig
from sparse_attn import methods
from sparse_attn.compression import flat
from sparse_attn.compression.rope import inverse_frequencies

B, HQ, HKV, D, T, STEPS, THETA, WINDOW = 2, 4, 2, 16, 64, 3, 100.0, 6
G = HQ // HKV
INV = inverse_frequencies(D, THETA)


def np_rope(x, pos):
  """Half-split RoPE of ``x [n, D]`` at ``pos [n]`` (float64)."""
  ang = np.asarray(pos, np.float64)[:, None] * INV.astype(np.float64)[None]
  x1, x2 = x[:, :D // 2], x[:, D // 2:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                         x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def problem(seed, lengths):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.normal(size=s)
  s = max(lengths)
  pos = np.full((B, s), -1)
  for b, n in enumerate(lengths):
    pos[b, :n] = np.arange(n)
  return dict(q0=f(B, HQ, s, D), k0=f(B, HKV, s, D), v=f(B, HKV, s, D), pos=pos,
              dq0=f(STEPS, B, HQ, D), dk0=f(STEPS, B, HKV, D), dv=f(STEPS, B, HKV, D))


def rotated(x0, pos):
  """``x0 [B, H, S, D]`` rotated per row at ``pos [B, S]`` (padding at 0), float32."""
  return jnp.asarray(np.stack([np.stack([np_rope(x0[b, h], np.maximum(pos[b], 0))
                                         for h in range(x0.shape[1])]) for b in range(B)]),
                     jnp.float32)


def run(m, p, lengths):
  """prefill -> end_prefill -> STEPS decode steps; the decode outputs ``[STEPS, B, HQ, D]``
  and the kept prompt positions per row and kv head."""
  cache = m.init_cache(B, HKV, T, D)
  state = m.init_state(B, HQ, HKV, D, T)
  _, cache, state = jax.jit(m.prefill)(rotated(p["q0"], p["pos"]), rotated(p["k0"], p["pos"]),
                                       jnp.asarray(p["v"], jnp.float32), cache, state,
                                       jnp.asarray(p["pos"], jnp.int32))
  cache, state = m.end_prefill(cache, state)
  view = flat.heads_view(cache) if isinstance(cache, flat.FlatKVCache) else cache
  pos, valid = np.asarray(view.pos), np.asarray(view.valid)
  kept = [[np.sort(pos[b, h][valid[b, h]]) for h in range(HKV)] for b in range(B)]
  outs, step = [], jax.jit(m.decode)
  for i in range(STEPS):
    at = np.asarray(lengths)[:, None] + i
    o, cache, state = step(rotated(p["dq0"][i][:, :, None], at),
                           rotated(p["dk0"][i][:, :, None], at),
                           jnp.asarray(p["dv"][i][:, :, None], jnp.float32), cache, state,
                           jnp.asarray(at, jnp.int32))
    outs.append(np.asarray(o)[:, :, 0])
  return np.stack(outs), kept


def kvpress_reference(p, kept, lengths, rerotate):
  """numpy decode outputs ``[STEPS, B, HQ, D]``: kept keys at ``0 .. n-1`` and the decoded
  tokens from ``n`` (``rerotate``), or every token at its own position."""
  out = np.zeros((STEPS, B, HQ, D))
  for b, length in enumerate(lengths):
    for h in range(HQ):
      kh = h // G
      idx = kept[b][kh]
      n = len(idx)
      base = n if rerotate else length
      prompt_at = np.arange(n) if rerotate else idx
      for i in range(STEPS):
        keys = np.concatenate([np_rope(p["k0"][b, kh, idx], prompt_at),
                               np_rope(p["dk0"][:i + 1, b, kh], base + np.arange(i + 1))])
        vals = np.concatenate([p["v"][b, kh, idx], p["dv"][:i + 1, b, kh]])
        q = np_rope(p["dq0"][i, b, h][None], [base + i])[0]
        s = keys @ q / np.sqrt(D)
        w = np.exp(s - s.max())
        out[i, b, h] = w @ vals / w.sum()
  return out


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**16), ratio=st.sampled_from([0.25, 0.5, 0.75]),
                  chunk=st.sampled_from([None, 16]), head_budget=st.sampled_from(
                      ["uniform", "adakv"]), short=st.integers(WINDOW + 2, 40))
def test_rerotated_decode_matches_kvpress_arithmetic(seed, ratio, chunk, head_budget, short):
  lengths = (40, short)
  p = problem(seed, lengths)
  m = methods.make("finch", ratio=ratio, window_size=WINDOW, chunk_length=chunk,
                   head_budget=head_budget, rope_theta=THETA)
  got, kept = run(m, p, lengths)
  assert all(len(kept[b][h]) < n for b, n in enumerate(lengths) for h in range(HKV))
  want = kvpress_reference(p, kept, lengths, rerotate=True)
  np.testing.assert_allclose(got, want, atol=5e-5, rtol=5e-5)


def test_without_rerotation_tokens_keep_their_positions_and_the_outputs_differ():
  lengths = (40, 29)
  p = problem(3, lengths)
  outs = {}
  for rerotate in (True, False):
    m = methods.make("finch", ratio=0.5, window_size=WINDOW, rope_theta=THETA,
                     rerotate_keys=rerotate)
    outs[rerotate], kept = run(m, p, lengths)
    np.testing.assert_allclose(outs[rerotate], kvpress_reference(p, kept, lengths, rerotate),
                               atol=5e-5, rtol=5e-5)
  assert not np.allclose(outs[True], outs[False], atol=1e-3)


def test_nothing_evicted_is_dense_and_no_rope_keeps_positions():
  """At ratio 0 the kept keys already are consecutive (nothing moves); without the model's RoPE
  there is nothing to re-rotate (the keys keep their positions)."""
  lengths = (40, 29)
  p = problem(5, lengths)
  dense, _ = run(methods.make("dense"), p, lengths)
  got, _ = run(methods.make("finch", ratio=0.0, window_size=WINDOW, rope_theta=THETA), p, lengths)
  np.testing.assert_allclose(got, dense, atol=2e-5, rtol=2e-5)
  bare, kept = run(methods.make("finch", ratio=0.5, window_size=WINDOW), p, lengths)
  np.testing.assert_allclose(bare, kvpress_reference(p, kept, lengths, rerotate=False),
                             atol=5e-5, rtol=5e-5)


def test_options_are_checked():
  assert methods.make("finch").rerotate_keys  # kvpress's default
  with pytest.raises(ValueError, match="rerotate_keys must be a bool"):
    methods.make("finch", rerotate_keys="yes")
  with pytest.raises(ValueError, match="rerotate_keys=False"):
    methods.make("finch", ratio=0.5, phase="both")
  assert methods.make("finch", ratio=0.5, phase="both", rerotate_keys=False).phase == "both"


def test_a_model_run_gives_the_method_the_models_rope():
  """``models.generate`` / ``teacher_forced`` hand the model's RoPE to the method, as the
  experiments do (``specs.for_model``), so FINCH re-rotates there without being told."""
  config = ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=64)
  m = decode.with_model_rope(methods.make("finch", ratio=0.5), config)
  assert m.rope_inv_freq == model_rope.model_inv_freq(config)
  own = methods.make("finch", ratio=0.5, rope_theta=THETA)
  assert decode.with_model_rope(own, config) is own  # a method's own RoPE wins
  quest = methods.make("quest", budget=0.5)
  assert decode.with_model_rope(quest, config) is quest


def _longrope_config() -> ModelConfig:
  """A tiny LongRoPE model (Phi-3's scaling): the long factors (4x) past 64 positions."""
  from models.rope_config import RopeConfig  # pylint: disable=g-import-not-at-top
  half = 4
  rope = RopeConfig(theta=1e4, rope_type="longrope", original_max_position_embeddings=64,
                    short_factor=(1.0,) * half, long_factor=(4.0,) * half)
  return ModelConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=2 * half, intermediate_size=64, rope=rope)


def test_the_runs_rope_reaches_a_sharded_method_with_longropes_factor_set():
  """The frequencies are the run's (LongRoPE's long set past the original context, as the
  run's RoPE tables) and a mesh-wrapped method keeps its wrapper."""
  from models import sharding  # pylint: disable=g-import-not-at-top
  config = _longrope_config()
  short, long = (model_rope.model_inv_freq(config.for_context(c)) for c in (64, 128))
  np.testing.assert_allclose(np.asarray(long) * 4.0, short, rtol=1e-6)
  wrapped = sharding.wrap(methods.make("finch", ratio=0.5), sharding.make_mesh())
  given = decode.with_model_rope(wrapped, config.for_context(128))
  assert isinstance(given, sharding.ShardedMethod) and given.inner.rope_inv_freq == long


@pytest.mark.parametrize("spec", ["finch", "expected_attention", "streaming_llm:positions=rolling"])
def test_the_runs_longrope_set_replaces_the_one_given_before_the_run(spec):
  """``specs.for_model`` gives a method the model's frequencies before the run's length is
  known (LongRoPE's short set); the run's ``with_model_rope`` then gives the long set past the
  original context, while frequencies the caller set stay."""
  config = _longrope_config()
  short, long = (model_rope.model_inv_freq(config.for_context(c)) for c in (64, 128))
  built = methods.make(spec, ratio=0.5).with_rope(short)  # as specs.for_model
  assert decode.with_model_rope(built, config.for_context(128)).rope_inv_freq == long
  assert decode.with_model_rope(built, config.for_context(64)).rope_inv_freq == short
  own = methods.make(spec, ratio=0.5, rope_inv_freq=short)
  assert decode.with_model_rope(own, config.for_context(128)) is own


def test_gemma3_local_layers_give_a_rope_method_their_own_frequencies():
  """A model whose local layers have their own RoPE (Gemma 3's ``rope_local_base_freq``): each
  layer's method models the layer's RoPE (FINCH re-rotates local keys with the local base);
  frequencies the caller set stay; selectors are unchanged."""
  from models import steps  # pylint: disable=g-import-not-at-top
  from models.rope_config import RopeConfig  # pylint: disable=g-import-not-at-top
  config = ModelConfig(vocab_size=32, hidden_size=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, intermediate_size=64,
                       rope=RopeConfig(theta=1e6), local_rope=RopeConfig(theta=1e4),
                       sliding_window=16, sliding_layers=(True, False))
  glob, loc = (model_rope.model_inv_freq(config, local) for local in (False, True))
  assert glob != loc
  m = decode.with_model_rope(methods.make("finch", ratio=0.5), config)
  assert steps.layer_method(m, config, True).rope_inv_freq == loc
  assert steps.layer_method(m, config, False).rope_inv_freq == glob
  own = methods.make("finch", ratio=0.5, rope_theta=THETA)
  assert steps.layer_method(own, config, True).rope_theta == THETA
  quest = methods.make("quest", budget=0.5)
  assert steps.layer_method(quest, config, True).spec == quest.with_sliding_window(16).spec
