"""The method registry and per-layer prefill/decode: a full budget is dense, jit and vmap equal
the plain call, an empty row gives 0 and never NaN (docs/architecture.md, "The method protocol")."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from tests.sparse_attn import helpers

SELECTORS = ["quest", "quest:gqa=group", "arkvale", "arkvale:variant=sphere", "topk",
             "topk:gqa=group", "streaming"]


def _run(method, rng, b=2, hq=4, hkv=2, d=16, prompt=(37, 20), steps=5, dtype=jnp.float32,
         scale=1.0):
  """Prefill rows of different lengths (right padding), then decode a few tokens."""
  cap = method.round_capacity(max(prompt) + steps)
  cache = method.init_cache(b, hkv, cap, d, dtype)
  state = method.init_state(b, hq, hkv, d, cap, dtype)
  s = max(prompt)
  pos = np.full((b, s), -1, np.int32)
  for i, n in enumerate(prompt):
    pos[i, :n] = np.arange(n)
  mk = lambda *shape: helpers.normal(rng, shape, dtype, scale)
  out, cache, state = method.prefill(mk(b, hq, s, d), mk(b, hkv, s, d), mk(b, hkv, s, d),
                                     cache, state, jnp.asarray(pos))
  cache, state = method.end_prefill(cache, state)
  outs = [out]
  step = jax.jit(method.decode)
  for t in range(steps):
    p = jnp.asarray(np.array(prompt)[:, None] + t, jnp.int32)
    o, cache, state = step(mk(b, hq, 1, d), mk(b, hkv, 1, d), mk(b, hkv, 1, d), cache, state, p)
    outs.append(o)
  return outs, cache


@pytest.mark.parametrize("spec", SELECTORS)
def test_full_budget_equals_dense_through_prefill_and_decode(spec):
  outs = {}
  for name in (spec, "dense"):
    m = methods.make(name, budget=1.0) if name != "dense" else methods.make("dense")
    outs[name], _ = _run(m, np.random.default_rng(0))
  for a, b in zip(outs[spec][1:], outs["dense"][1:]):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("spec", SELECTORS)
def test_sparse_budget_differs_from_dense_but_stays_finite(spec):
  m = methods.make(spec, budget=0.1, n_sink=0, local_window=0, block_size=4)
  outs, cache = _run(m, np.random.default_rng(1), prompt=(90, 60))
  dense, _ = _run(methods.make("dense", block_size=4), np.random.default_rng(1), prompt=(90, 60))
  assert not np.allclose(outs[-1], dense[-1], atol=1e-3)  # it really is sparse
  assert all(np.isfinite(np.asarray(o)).all() for o in outs)
  np.testing.assert_array_equal(cache.length, [95, 65])


@pytest.mark.parametrize("spec", ["dense"] + SELECTORS)
def test_no_nan_for_empty_rows_bf16_large_logits_and_huge_budgets(spec):
  m = methods.make(spec) if spec == "dense" else methods.make(spec, budget=10_000)
  rng = np.random.default_rng(2)
  outs, _ = _run(m, rng, prompt=(0, 33), dtype=jnp.bfloat16, scale=30.0)  # |q.k| ~ 1e4
  for o in outs:
    assert np.isfinite(np.asarray(o, np.float32)).all()
  # an empty cache decoded by a padding row (position -1) attends nothing
  c = m.init_cache(1, 1, 16, 8)
  q = jnp.ones((1, 2, 1, 8))
  o, c, _ = m.decode(q, q[:, :1], q[:, :1], c, {}, jnp.array([[-1]]))
  assert np.all(np.asarray(o) == 0) and int(c.length[0]) == 0


@pytest.mark.parametrize("spec", ["dense", "quest", "topk:gqa=group"])
def test_jit_and_vmap_equal_plain_call(spec):
  m = methods.make(spec) if spec == "dense" else methods.make(spec, budget=0.25, block_size=8)
  rng = np.random.default_rng(3)
  n, b, hq, hkv, d, t = 3, 2, 4, 2, 8, 64
  caches = [helpers.filled_cache(rng, b, hkv, t, d, [40, 17], block_size=8) for _ in range(n)]
  q = helpers.normal(rng, (n, b, hq, 1, d)); k = helpers.normal(rng, (n, b, hkv, 1, d))
  pos = jnp.array([[40], [17]])
  plain = [m.decode(q[i], k[i], k[i], caches[i], {}, pos)[0] for i in range(n)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *caches)
  vm = jax.jit(jax.vmap(m.decode, in_axes=(0, 0, 0, 0, None, None)))(q, k, k, stacked, {}, pos)[0]
  jt = jax.jit(m.decode)(q[0], k[0], k[0], caches[0], {}, pos)[0]
  np.testing.assert_allclose(jt, plain[0], atol=1e-6)
  for i in range(n):
    np.testing.assert_allclose(vm[i], plain[i], atol=1e-6)


def test_make_parses_specs_and_rejects_unknowns():
  m = methods.make("quest:gqa=group,block_size=32", budget=0.05)
  assert (m.selector.gqa, m.block_size, m.budget.budget) == ("group", 32, 0.05)
  r = methods.make("quest", p=0.1)
  assert (r.budget.budget, r.budget.p, r.budget.n_min, r.budget.n_local) == (None, 0.1, 16, 1)
  assert hash(m) != hash(r)  # static, hashable configs
  assert methods.make("topk", budget=2048).budget.budget == 2048
  with pytest.raises(ValueError, match="unknown method 'qwest'.*'quest'"):
    methods.make("qwest")
  with pytest.raises(ValueError, match=r"unknown method 'qwest' in 'qwest\+resa'; valid") as e:
    methods.make("qwest+resa", budget=0.1, block_size=16)  # keywords the caller never typed
  assert "block_size" not in str(e.value) and "budget" not in str(e.value)
  with pytest.raises(ValueError, match="unknown option.*'budgett'.*valid options"):
    methods.make("quest", budgett=0.1)
  with pytest.raises(ValueError, match="unknown option"):
    methods.make("dense", budget=0.1)
  with pytest.raises(ValueError, match="gqa"):
    methods.make("quest", gqa="pooled")
  with pytest.raises(ValueError, match="impl"):
    methods.make("quest", impl="cuda")
  with pytest.raises(ValueError, match=r"exposed must be one of \('kernel', 'xla'\)"):
    methods.make("quest+retro:w=2,exposed=gpu")
  with pytest.raises(ValueError, match="either budget or"):
    methods.make("quest", budget=0.1, p=0.1)
  with pytest.raises(ValueError, match="key=value"):
    methods.make("quest:gqa")
  assert methods.make("quest").round_capacity(17) == 32


def test_adaptive_budget_specs_compose_and_reach_dense():
  m = methods.make("quest:topp=0.9+resa", budget=0.5)
  assert (m.selector.topp, bool(m.resa)) == (0.9, True)
  assert methods.make("arkvale", adakv=0.2).selector.adakv == 0.2
  # top-p with tau = 1 under a full budget attends everything: equals dense
  full, _ = _run(methods.make("quest", topp=1.0, budget=1.0), np.random.default_rng(4))
  dense, _ = _run(methods.make("dense"), np.random.default_rng(4))
  for a, b in zip(full[1:], dense[1:]):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
  outs, _ = _run(methods.make("quest", adakv=0.2, budget=0.2, block_size=4),
                 np.random.default_rng(5), prompt=(90, 60))
  assert all(np.isfinite(np.asarray(o)).all() for o in outs)
  with pytest.raises(ValueError, match="not both"):
    methods.make("quest", topp=0.9, adakv=0.2)
  with pytest.raises(ValueError, match=r"unknown option\(s\) \[.topp.\] for .topk."):
    methods.make("topk", topp=0.9)
  with pytest.raises(ValueError, match="topp must be"):
    methods.make("quest", topp=1.5)


def test_pallas_dispatch_in_interpret_mode_equals_xla():
  """impl='pallas' routes Quest scoring and sparse decode through the kernels."""
  rng = np.random.default_rng(6)
  c = helpers.filled_cache(rng, 1, 2, 128, 64, [100], block_size=16)
  q = helpers.normal(rng, (1, 4, 64))
  pos = jnp.array([99])
  for spec in ("quest", "quest:gqa=group"):
    got = methods.make(spec, budget=0.3, impl="pallas", interpret=True).attend(q, c, pos)
    want = methods.make(spec, budget=0.3, impl="xla").attend(q, c, pos)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got[1], want[1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_decode_split_k_kernel_equals_the_reference(dtype):
  """Dense decode with impl='pallas' is split-K flash decoding over every block (interpret
  mode): equal to the reference for ragged lengths, a GQA group, and an inactive row."""
  rng = np.random.default_rng(7)
  c = helpers.filled_cache(rng, 3, 2, 256, 64, [200, 37, 0], block_size=16, dtype=dtype)
  q = helpers.normal(rng, (3, 8, 64), dtype=dtype)
  pos = jnp.array([199, 36, -1])
  got = methods.make("dense", impl="pallas", interpret=True).attend(q, c, pos)
  want = methods.make("dense", impl="xla").attend(q, c, pos)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                             atol=tol, rtol=tol)
  np.testing.assert_allclose(got[1][:2], want[1][:2], atol=1e-4, rtol=1e-4)
  assert np.all(np.asarray(got[0][2]) == 0) and np.all(np.isneginf(got[1][2]))


@pytest.mark.parametrize("spec, options", [
    ("resa-quest", {"lam": 0.25, "budget": 0.05}),
    ("quest:gqa=group+rect:f=16", {"f": 8, "n_sink": 0}),
    ("expected-attention", {"ratio": 0.75, "eps": 0.0}),
    ("dense", {"impl": "xla"}),
])
def test_spec_names_the_keyword_options_it_was_built_with(spec, options):
  m = methods.make(spec, **options)
  for key, value in options.items():
    assert f"{key}={value}" in m.spec
  assert methods.make(m.spec) == m  # the string alone rebuilds the same method
