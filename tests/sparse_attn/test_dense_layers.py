"""``Method.dense_layers`` (the first layers dense, as Quest's evaluation code runs them): per
layer a decode step equals dense below the cut and the plain selector above it (jit and vmap
agree), through the model the cut at 0 / every layer is the plain selector / dense, the
per-layer and one-program steps agree, the accounting averages the layers, and bad options
are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.tasks import accuracy_report
from models import decode, llama, sharding, steps
from models.config import ModelConfig, RopeConfig
from models.loading import Model
from sparse_attn import methods
from tests.sparse_attn import helpers

CAP, D, LAYERS = 32, 8, 4


def _stack(m, qs, ks, vs, caches, positions):
  """One decode step through the layers as ``models.steps`` runs them (``per_layer``)."""
  outs = []
  for i, (q, k, v, c) in enumerate(zip(qs, ks, vs, caches)):
    lm = steps.per_layer(m, i, len(qs))
    outs.append(lm.decode(q, k, v, c, lm.init_state(1, 1, 1, 1, 1), positions)[0])
  return outs


def _problem(rng, lengths):
  b = len(lengths)
  caches = [helpers.filled_cache(rng, b, 2, CAP, D, lengths, 4, jnp.float32, 1.0)
            for _ in range(LAYERS)]
  qs = [helpers.normal(rng, (b, 4, 1, D), jnp.float32, 1.0) for _ in range(LAYERS)]
  ks = [helpers.normal(rng, (b, 2, 1, D), jnp.float32, 1.0) for _ in range(LAYERS)]
  vs = [helpers.normal(rng, (b, 2, 1, D), jnp.float32) for _ in range(LAYERS)]
  return qs, ks, vs, caches, jnp.asarray(np.array(lengths, np.int32)[:, None])


@pytest.mark.parametrize("cut", [0, 1, 3, LAYERS])
def test_layers_below_the_cut_are_dense_and_the_rest_the_selector(cut):
  rng = np.random.default_rng(cut)
  qs, ks, vs, caches, pos = _problem(rng, [29, 12])
  kw = dict(budget=8, block_size=4, n_sink=0, local_window=0)
  m = methods.make("quest", dense_layers=cut, **kw)
  dense, plain = methods.make("dense", block_size=4), methods.make("quest", **kw)
  got = jax.jit(_stack, static_argnums=0)(m, qs, ks, vs, caches, pos)
  for i, (out, q, k, v, c) in enumerate(zip(got, qs, ks, vs, caches)):
    ref = dense if i < cut else plain
    want = ref.decode(q, k, v, c, ref.init_state(2, 4, 2, D, CAP), pos)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **helpers.tol(jnp.float32))
    other = plain if i < cut else dense
    away = other.decode(q, k, v, c, other.init_state(2, 4, 2, D, CAP), pos)[0]
    assert np.abs(np.asarray(out) - np.asarray(away)).max() > 1e-3  # the budget really bites

  def one(q, k, v, c, p):  # one row: [L, ...] stacks of the layers' inputs
    row = lambda xs: [x[None] for x in xs]
    return jnp.stack(_stack(m, row(q), row(k), row(v),
                            [jax.tree.map(lambda x: x[None], l) for l in c], p[None]))[:, 0]

  mapped = jax.jit(jax.vmap(one))(jnp.stack(qs, 1), jnp.stack(ks, 1), jnp.stack(vs, 1), caches,
                                  pos)
  for i, out in enumerate(got):
    np.testing.assert_allclose(np.asarray(out), np.asarray(mapped[:, i]),
                               **helpers.tol(jnp.float32))


CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=5,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=1e4))


def test_through_the_model(monkeypatch):
  """Every layer dense is dense; none is the plain selector; two differ from both, and the
  per-layer and one-program decode steps agree."""
  model = Model(CONFIG, llama.init_params(CONFIG, jax.random.key(0)), None)
  tokens = np.random.default_rng(3).integers(0, 61, (2, 40))
  kw = dict(prefill_chunk=16, capacity=48)
  run = lambda m: decode.teacher_forced(model, tokens, 24, m, **kw)
  few = dict(budget=4, block_size=4, n_sink=0, local_window=4)  # 2 blocks of the ~40 tokens
  quest = lambda n: methods.make("quest", dense_layers=n, **few)
  dense, plain, two = run(methods.make("dense", block_size=4)), run(quest(0)), run(quest(2))
  np.testing.assert_allclose(run(quest(CONFIG.num_layers)), dense, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(run(methods.make("quest", **few)), plain,
                             atol=2e-5, rtol=2e-5)
  assert np.abs(two - dense).max() > 1e-3 and np.abs(two - plain).max() > 1e-3
  monkeypatch.setattr(steps, "fused_by_default", lambda: True)
  np.testing.assert_allclose(run(quest(2)), two, atol=2e-5, rtol=2e-5)


def test_accounting_averages_the_layers():
  m = methods.make("quest:dense_layers=2", budget=0.1)
  acc = m.attended_tokens(4096, 24)
  assert acc["full_layers"] == 2 and acc["layers"] == 24
  assert acc["layer_mean"] == pytest.approx((2 * 4096 + 22 * acc["total"]) / 24)
  assert accuracy_report.read_per_head(acc) == acc["layer_mean"]
  plain = methods.make("quest", budget=0.1).attended_tokens(4096, 24)
  assert plain["full_layers"] == 0 and plain["layer_mean"] == plain["total"]
  assert accuracy_report.read_per_head({"total": 7}) == 7  # records before layer accounting
  # TidalDecode attends everything in layers 0, 1 and its selection layers 2 and 13
  assert methods.make("tidaldecode", budget=0.1).attended_tokens(4096, 24)["full_layers"] == 4
  assert methods.make("rocketkv", budget=0.1).attended_tokens(4096, 24)["full_layers"] == 0
  assert m.attended_tokens(4096) == _without_layers(m.attended_tokens(4096, 24))


def _without_layers(acc):
  return {k: v for k, v in acc.items() if k not in ("layers", "full_layers", "layer_mean")}


def test_spec_options_refusals_and_sharding():
  m = methods.make("quest:dense_layers=2", budget=0.1)
  assert m.dense_layers == 2 and "dense_layers=2" in m.spec
  assert methods.make(m.spec) == m
  assert steps.per_layer(m, 1, 24).is_dense and steps.per_layer(m, 2, 24) is m
  assert steps.per_layer(m, 0, 24).cache_digests == m.cache_digests  # the box kept up to date
  assert methods.make("twilight", budget=0.1, dense_layers=2).dense_layers == 2
  with pytest.raises(ValueError, match="dense_layers"):
    methods.make("dense", dense_layers=2)
  with pytest.raises(ValueError, match="RESA or retro"):
    methods.make("quest+resa", budget=0.1, dense_layers=2)
  with pytest.raises(ValueError, match="sparse_start"):
    methods.make("tidaldecode", budget=0.1, dense_layers=2)
  with pytest.raises(ValueError, match="dense_layers must be an int >= 0, got 'two'"):
    methods.make("quest:dense_layers=two", budget=0.1)
  for bad in (-1, True, 1.5):
    with pytest.raises(ValueError, match="dense_layers must be"):
      methods.Method(selector=m.selector, dense_layers=bad)
  # a sharded method's layers stay sharded
  wrapped = sharding.wrap(m, sharding.make_mesh())
  layer0 = steps.per_layer(wrapped, 0, 24)
  assert isinstance(layer0, sharding.ShardedMethod) and layer0.inner.is_dense
  assert steps.per_layer(wrapped, 5, 24) == wrapped


def test_quest_paper_preset():
  """Quest as its evaluation code runs it: two dense layers, nothing forced, >= 3 blocks."""
  m = methods.make("quest-paper", budget=1024)
  assert m.dense_layers == 2 and m.selector.name == "quest"
  assert (m.budget.n_sink, m.budget.local_window, m.budget.min_tokens) == (0, 0, 48)
  assert m.attended_tokens(100_000)["total"] == 1024
  # a budget under 3 blocks is raised to 3 (Quest's max(3, token_budget // chunk_size))
  assert methods.make("quest-paper", budget=0.01).attended_tokens(1000)["total"] == 48
