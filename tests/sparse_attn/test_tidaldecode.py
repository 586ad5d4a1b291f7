"""TidalDecode (sparse_attn/selectors/tidal.py, sparse_attn/tidal.py): a brute-force numpy
reference of a decode step through a stack of layers (dense, selection and reuse layers) on
random inputs, the invariants (a full budget is dense, jit and vmap agree, padding rows and
bf16 logits of 1e4 never NaN), the model's decode loop relaying the selection (per-layer and
one-program steps agree; a full budget decodes as dense) and the spec options."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode, llama, steps
from models.config import ModelConfig, RopeConfig
from models.loading import Model
from sparse_attn import methods
from sparse_attn.budget import Budget
from sparse_attn.selectors import TidalDecode
from sparse_attn.tidal import TidalMethod
from tests.sparse_attn import helpers

CAP, D = 32, 8


def _stack(m, qs, ks, vs, caches, positions):
  """One decode step through ``len(qs)`` layers as ``models.steps`` runs it (relay threaded)."""
  relay, outs = None, []
  for i, (q, k, v, c) in enumerate(zip(qs, ks, vs, caches)):
    lm = steps.per_layer(m, i, len(qs))
    if hasattr(lm, "decode_relay"):
      out, c, _, relay = lm.decode_relay(q, k, v, c, lm.init_state(1, 1, 1, 1, 1), relay,
                                         positions)
    else:
      out, c, _ = lm.decode(q, k, v, c, lm.init_state(1, 1, 1, 1, 1), positions)
    outs.append(out)
  return outs


_jit_stack = jax.jit(_stack, static_argnums=0)


def _problem(rng, b, hq, hkv, lengths, layers, dtype=jnp.float32, scale=1.0):
  caches = [helpers.filled_cache(rng, b, hkv, CAP, D, lengths, 4, dtype, scale)
            for _ in range(layers)]
  qs = [helpers.normal(rng, (b, hq, 1, D), dtype, scale) for _ in range(layers)]
  ks = [helpers.normal(rng, (b, hkv, 1, D), dtype, scale) for _ in range(layers)]
  vs = [helpers.normal(rng, (b, hkv, 1, D), dtype) for _ in range(layers)]
  return qs, ks, vs, caches, jnp.asarray(np.array(lengths, np.int32)[:, None])


def _reference(sel: TidalDecode, qs, ks, vs, caches, lengths, count):
  """float64 outputs per layer (None where the k-th and (k+1)-th logits nearly tie)."""
  outs, chosen = [], None
  for i, (q, k_new, v_new, c) in enumerate(zip(qs, ks, vs, caches)):
    q, k_new, v_new = (np.asarray(x, np.float64) for x in (q, k_new, v_new))
    b, hq = q.shape[:2]
    g = hq // k_new.shape[1]
    out = np.zeros((b, hq, 1, D))
    role = sel.role(i)
    pick = {}
    for r in range(b):
      n = lengths[r] + 1
      keys = np.concatenate([np.asarray(c.k, np.float64)[r, :, :lengths[r]], k_new[r]], axis=1)
      vals = np.concatenate([np.asarray(c.v, np.float64)[r, :, :lengths[r]], v_new[r]], axis=1)
      for h in range(hq):
        lg = keys[h // g] @ q[r, h, 0] / np.sqrt(D)
        if role == "reuse":
          ids = chosen[r, h]
        else:
          ids = np.arange(n)
          if role == "select":
            kk = min(count, n)
            srt = np.sort(lg)[::-1]
            if kk < n and srt[kk - 1] - srt[kk] < 1e-4:
              return None
            pick[r, h] = np.argsort(-lg)[:kk]
        w = np.exp(lg[ids] - lg[ids].max())
        out[r, h, 0] = (w / w.sum()) @ vals[h // g][ids]
    if role == "select":
      chosen = pick
    outs.append(out)
  return outs


@hypothesis.settings(deadline=None, max_examples=8, derandomize=True)
@hypothesis.given(seed=st.integers(0, 2 ** 16), count=st.integers(1, 20),
                  group=st.sampled_from([1, 2]), start=st.integers(0, 2),
                  reselect=st.sampled_from([None, 3]))
def test_a_decode_step_matches_a_brute_force_reference(seed, count, group, start, reselect):
  rng = np.random.default_rng(seed)
  lengths = [int(rng.integers(1, CAP - 1)), int(rng.integers(1, CAP - 1))]
  qs, ks, vs, caches, pos = _problem(rng, 2, 2 * group, 2, lengths, 5)
  m = methods.make("tidaldecode", budget=count, sparse_start=start,
                   reselect=reselect if reselect is None or reselect > start else None)
  want = _reference(m.selector, qs, ks, vs, caches, lengths, count)
  hypothesis.assume(want is not None)
  for got, ref in zip(_jit_stack(m, qs, ks, vs, caches, pos), want, strict=True):
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=1e-5)


def test_roles_and_a_full_budget_is_dense():
  sel = TidalDecode(budget=1.0)
  assert [sel.role(i) for i in range(15)] == (["dense"] * 2 + ["select"] + ["reuse"] * 10
                                              + ["select", "reuse"])
  rng = np.random.default_rng(1)
  qs, ks, vs, caches, pos = _problem(rng, 2, 4, 2, [30, 7], 5)
  dense = methods.make("dense", block_size=4)
  m = methods.make("tidaldecode", budget=1.0, block_size=4, sparse_start=1, reselect=3)
  for got, c, q, k, v in zip(_stack(m, qs, ks, vs, caches, pos), caches, qs, ks, vs):
    want = dense.decode(q, k, v, c, dense.init_state(2, 4, 2, D, CAP), pos)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **helpers.tol(jnp.float32))


def test_jit_vmap_padding_and_large_bf16_logits():
  rng = np.random.default_rng(2)
  qs, ks, vs, caches, pos = _problem(rng, 2, 4, 2, [0, 19], 4, jnp.bfloat16, scale=35.0)
  pos = pos.at[0, 0].set(-1)  # a padding row beside a real one
  m = methods.make("tidaldecode", budget=5, block_size=4, sparse_start=1, reselect=None)
  plain = _stack(m, qs, ks, vs, caches, pos)
  jitted = _jit_stack(m, qs, ks, vs, caches, pos)

  def one(q, k, v, c, p):  # one row: [L, ...] stacks of the layers' inputs, [1] position
    row = lambda xs: [x[None] for x in xs]
    return jnp.stack(_stack(m, row(q), row(k), row(v), [jax.tree.map(lambda x: x[None], l)
                                                        for l in c], p[None]))[:, 0]

  mapped = jax.jit(jax.vmap(one))(jnp.stack(qs, 1), jnp.stack(ks, 1), jnp.stack(vs, 1), caches, pos)
  for i, (a, b) in enumerate(zip(plain, jitted)):
    assert np.all(np.isfinite(np.asarray(a, np.float32)))
    assert not np.any(np.asarray(a[0], np.float32))  # the padding row attends nothing
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               **helpers.tol(jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(mapped[:, i], np.float32),
                               **helpers.tol(jnp.bfloat16))


def test_spec_options_and_refusals():
  m = methods.make("tidaldecode", budget=0.1)
  assert isinstance(m, TidalMethod) and m.selector == TidalDecode(
      budget=Budget(budget=0.1, n_sink=0, local_window=0))
  assert (m.selector.sparse_start, m.selector.reselect) == (2, 13)
  assert methods.make("tidaldecode:reselect=-1", budget=64).selector.reselect is None
  kept = methods.make("tidaldecode", budget=64, local_window=1, forced_count="inside")
  assert kept.budget.local_window == 1 and kept.budget.n_sink == 0
  assert steps.per_layer(m, 0, 32).is_dense and steps.per_layer(m, 2, 32).role == "select"
  assert steps.per_layer(m, 3, 32) == steps.per_layer(m, 30, 32)  # one compile per role
  with pytest.raises(ValueError, match="enhancers"):
    methods.make("tidaldecode+resa", budget=0.1)
  with pytest.raises(ValueError, match="reselect"):
    TidalDecode(budget=0.1, sparse_start=3, reselect=2)
  with pytest.raises(NotImplementedError, match="sliding window"):
    m.with_sliding_window(8)
  with pytest.raises(NotImplementedError, match="decode through models.steps"):
    m.decode(*[None] * 6)


CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=5,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=1e4))


@pytest.fixture(scope="module")
def model():
  return Model(CONFIG, llama.init_params(CONFIG, jax.random.key(0)), None)


def test_the_decode_loop_relays_the_selection(model, monkeypatch):
  """Through the model: a full budget decodes as dense; at a small one the per-layer steps and
  the one-program step agree, and differ from dense (the reuse layers really are sparse)."""
  tokens = np.random.default_rng(3).integers(0, 61, (2, 40))
  kw = dict(prefill_chunk=16, capacity=48)
  dense = decode.teacher_forced(model, tokens, 24, methods.make("dense"), **kw)
  full = methods.make("tidaldecode", budget=1.0, sparse_start=1, reselect=3)
  np.testing.assert_allclose(decode.teacher_forced(model, tokens, 24, full, **kw), dense,
                             atol=2e-5, rtol=2e-5)
  small = methods.make("tidaldecode", budget=4, sparse_start=1, reselect=3)
  per_layer = decode.teacher_forced(model, tokens, 24, small, **kw)
  assert np.abs(per_layer - dense).max() > 1e-3
  monkeypatch.setattr(steps, "fused_by_default", lambda: True)
  np.testing.assert_allclose(decode.teacher_forced(model, tokens, 24, small, **kw), per_layer,
                             atol=2e-5, rtol=2e-5)
  assert dataclasses.replace(small, role="reuse").role == "reuse"
