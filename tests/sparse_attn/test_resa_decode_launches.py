"""RESA's decode step in fewer launches (issue 51 item 2): the prior update as one Pallas kernel
(``pallas_kernels.resa_prior_update``) and the aggregator's inputs computed in the split
combine's epilogue (``resa.StateAggregator``). Each equals what it replaces (interpret mode,
hypothesis shapes); the step equals the jnp path and the previous path (``resa:fused=false``,
kept for the GPU comparison); exported for CUDA at Llama-3.1-8B's shape the step has one launch for
the update and far fewer XLA ops, and every cache and state leaf is updated in place."""

from __future__ import annotations

import collections
import functools
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import ptx, resa_prior_update, resa_prior_update_reference
from pallas_kernels.shapes import BF16, S
from sparse_attn import cache as cache_lib, kernels, methods
from sparse_attn.enhancers import resa

# (batch, kv heads, group, slots, head dim): fixed shapes keep compiled programs warm.
POOL = [(1, 1, 4, 64, 32), (2, 2, 3, 48, 16)]
NAMES = ("prior", "pmax", "zsum", "osum", "ksum", "kcount")
close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32),
                                                np.asarray(b, np.float32), rtol=2e-5, atol=2e-5)


def _formed(rng, b, kh, g, t, d, filled, scale):
  """A cache of ``filled`` random tokens and the RESA state formed over it."""
  cache = cache_lib.init_cache(b, kh, t, d, 16, jnp.bfloat16, ("box",))
  kv = [jnp.asarray(rng.standard_normal((b, kh, filled, d)), jnp.bfloat16) for _ in range(2)]
  cache = cache_lib.write(cache, *kv, jnp.broadcast_to(jnp.arange(filled), (b, filled)))
  state = resa.init_state(b, kh * g, kh, d, t)
  q = jnp.asarray(rng.standard_normal((b, kh * g, 4, d)), jnp.float32)
  state = resa.accumulate_queries(state, q, jnp.broadcast_to(jnp.arange(4), (b, 4)))
  return cache, resa.form_prior(state, cache, scale)


@settings(deadline=None, max_examples=3)
@given(shape=st.sampled_from(POOL), incremental=st.booleans(),
       where=st.sampled_from(("fresh", "member", "pad")), seed=st.integers(0, 2**16))
def test_prior_update_kernel_equals_update_prior(shape, incremental, where, seed):
  rng = np.random.default_rng(seed)
  b, kh, g, t, d = shape
  cache, state = _formed(rng, b, kh, g, t, d, 40, 0.3)
  slot = {"fresh": rng.integers(40, t, b), "member": rng.integers(0, 40, b),
          "pad": rng.choice([-1, t], b)}[where]
  slot = jnp.asarray(slot, jnp.int32)
  kn, vn = (jnp.asarray(rng.standard_normal((b, kh, d)), jnp.bfloat16) for _ in range(2))
  want = resa.update_prior(state, cache, kn[:, :, None], vn[:, :, None], slot[:, None], 0.3,
                           incremental)
  args = (*(getattr(state, x) for x in NAMES), state.mu_q, cache.k, cache.v, kn, vn, slot)
  kw = dict(scale=0.3, incremental=incremental)
  for got in (resa_prior_update_reference(*args, **kw),
              resa_prior_update(*args, impl="pallas", interpret=True, **kw)):
    for name, x in zip(NAMES, got):
      close(x, getattr(want, name))


def test_state_aggregator_equals_aggregate(lam=0.25, form="renormalised", head=True):
  """The epilogue's own inputs == ``total`` / ``online_bias`` / ``prior_count`` in XLA."""
  rng = np.random.default_rng(1)
  b, kh, g, t, d = POOL[1]
  cache, state = _formed(rng, b, kh, g, t, d, 40, 0.3)
  if head:
    state = resa.with_head_params(state, rng.normal(size=kh * g), rng.uniform(0.5, 2, kh * g))
  m = methods.make("quest+resa", budget=0.25, block_size=16, n_sink=2, local_window=16)
  q = jnp.asarray(rng.standard_normal((b, kh * g, d)), jnp.bfloat16)
  args = (q, cache, m.select(q, cache), state.prior, 0.3)
  true, seen_part, seen = kernels.resa_partials(*args, impl="xla")
  inputs = (*resa.total(state), resa.online_bias(state, q, 0.3, form),
            resa.prior_count(state, kh * g))
  jnp_ref = resa.aggregate(true, seen_part, inputs[:2], inputs[2], lam, seen >= inputs[3], form)
  agg = resa.StateAggregator(lam, form, 0.3)
  for impl in ("xla", "pallas"):  # (bf16 dots: the kernel's partials differ from jnp's)
    got = kernels.resa_attend(*args, agg, resa.aggregator_inputs(state, q), impl=impl,
                              interpret=True)
    want = kernels.resa_attend(*args, resa.Aggregator(lam, form), inputs, impl=impl,
                               interpret=True)
    jax.tree.map(close, got, want)
    if impl == "xla":
      jax.tree.map(close, got, jnp_ref)


SPEC = "quest:gqa=group+resa:prior_update=incremental"


def test_decode_step_equals_jnp_and_previous_path():
  rng = np.random.default_rng(2)
  b, hkv, g, t, d = 2, 2, 2, 256, 32
  make = lambda impl, spec=SPEC: methods.make(spec, budget=0.25, block_size=16, n_sink=4,
                                              local_window=16, impl=impl, interpret=True)
  ms = {"pallas": make("pallas"), "xla": make("xla"),
        "previous": make("pallas", SPEC + ",fused=false")}
  cache = ms["xla"].init_cache(b, hkv, t, d, jnp.bfloat16)
  state = ms["xla"].init_state(b, hkv * g, hkv, d, t, jnp.bfloat16)
  pos = jnp.broadcast_to(jnp.arange(150), (b, 150))
  r = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  _, cache, state = ms["xla"].prefill(r(b, hkv * g, 150, d), r(b, hkv, 150, d),
                                      r(b, hkv, 150, d), cache, state, pos)
  cache, state = ms["xla"].end_prefill(cache, state)
  runs = {name: (cache, state) for name in ("pallas", "xla", "previous")}
  for p in ([150, 77], [151, -1]):  # new slots, an overwritten one, a padding row
    q, k, v = r(b, hkv * g, 1, d), r(b, hkv, 1, d), r(b, hkv, 1, d)
    p = jnp.asarray(p, jnp.int32)[:, None]
    outs = {}
    for name, (c, s) in runs.items():
      o, c, s = ms[name].decode(q, k, v, c, s, p)
      outs[name], runs[name] = o, (c, s)
    close(outs["pallas"], outs["previous"])
    np.testing.assert_allclose(np.asarray(outs["pallas"], np.float32),
                               np.asarray(outs["xla"], np.float32), atol=2e-2, rtol=2e-2)
    for name in NAMES:
      close(getattr(runs["pallas"][1].resa, name), getattr(runs["previous"][1].resa, name))
      close(getattr(runs["pallas"][1].resa, name), getattr(runs["xla"][1].resa, name))


def _export(m, t):
  """``m``'s decode step at the 8B shape (Hq 32, Hkv 8, D 128, block 16, bf16) for CUDA, cache and
  state donated -> the StableHLO text."""
  cache = jax.eval_shape(lambda: m.init_cache(1, 8, t, 128, BF16))
  state = jax.eval_shape(lambda: m.init_state(1, 32, 8, 128, t, BF16))
  f = jax.jit(lambda c, s, q, k, v, p: m.decode(q, k, v, c, s, p), donate_argnums=(0, 1))
  x = S((1, 8, 1, 128), BF16)
  return jax.export.export(f, platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call(ptx.TRITON_CALL)])(
          cache, state, S((1, 32, 1, 128), BF16), x, x, S((1, 1), jnp.int32)).mlir_module()


LAYOUT = {"reshape", "constant", "broadcast_in_dim", "convert", "iota", "custom_call"}


def counts(text):
  """``(Triton launches, StableHLO ops, compute ops (no layout, constants or kernels))``."""
  ops = collections.Counter(re.findall(r"= \"?stablehlo\.([a-z_]+)", text))
  return (text.count(f"stablehlo.custom_call @{ptx.TRITON_CALL}"), sum(ops.values()),
          sum(v for k, v in ops.items() if k not in LAYOUT))


def test_cuda_export_at_8b_128k_has_fewer_ops_and_updates_in_place():
  """At 131072 slots (Llama-3.1-8B's heads): 6 Triton launches (the prior update's own) where
  the previous step had 5 plus its XLA update; RESA adds no compute op to Quest's step, which
  has none (mu_K's divide is the combine epilogue's since 2026-12-03; the padding rows are
  emptied inside the kernels and the combine since 2026-12-04). Every cache and state leaf is an aliased (in-place) output."""
  make = lambda spec: methods.make(spec, p=0.1, block_size=16, impl="pallas")
  m, prev, base = (make(x) for x in ("quest:gqa=group+resa", "quest:gqa=group+resa:fused=false",
                                     "quest:gqa=group"))
  new, old, quest = (_export(x, 131072) for x in (m, prev, base))
  (n_new, ops_new, comp_new), (n_old, ops_old, comp_old) = counts(new), counts(old)
  n_q, _, comp_q = counts(quest)
  assert (n_new, n_old, n_q) == (6, 5, 5)
  assert comp_new == comp_q == 0 and comp_new < comp_old and ops_new < ops_old
  assert "name = \"resa_prior_update\"" in new
  main = new[new.index("func.func public @main"):].split("\n", 1)[0]
  leaves = len(jax.tree.leaves(jax.eval_shape(lambda: (m.init_cache(1, 8, 64, 128, BF16),
                                                       m.init_state(1, 32, 8, 128, 64, BF16)))))
  assert main.count("tf.aliasing_output") == leaves


def test_prior_update_compiles_for_sm90_without_spills():
  """(``ptx`` extra) The kernel at 128k slots compiles for an H100: 8 programs, no spill."""
  pytest.importorskip("triton")
  f32, t = jnp.float32, 131072
  fn = functools.partial(resa_prior_update, scale=128 ** -0.5, incremental=True, impl="pallas")
  avals = (S((1, 32, t), f32), S((1, 32), f32), S((1, 32), f32), S((1, 32, 128), f32),
           S((1, 8, 128), f32), S((1, 8), jnp.int32), S((1, 32, 128), f32),
           S((1, 8, t, 128), BF16), S((1, 8, t, 128), BF16), S((1, 8, 128), BF16),
           S((1, 8, 128), BF16), S((1,), jnp.int32))
  (module,) = ptx.triton_modules(fn, *avals)
  assert module.grid == (1, 8, 1)
  with tempfile.TemporaryDirectory() as d:
    assert ptx.register_usage(ptx.compile_sm90(module, d), d)["spill_bytes"] == 0
