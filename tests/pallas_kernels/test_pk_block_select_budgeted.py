"""A block selection's bookkeeping inside the kernels (``row_budget``): ``block_select_budgeted``
and ``score_select(row_budget=...)`` derive each row's count and local start from its length
with ``sparse_attn.kernels.RowBudget`` and list exactly what the same kernels list from those
numbers computed outside (interpret mode; their XLA paths equal too); ``Budget.count``'s
fraction rule is bit-equal to the float32 division it replaces; the rule compiles for sm_90
with no approximate division; and Quest's decode step at the 8B shape exports for CUDA with no
XLA arithmetic left but the padding rows' mask."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import block_select_budgeted, block_select_ranked, score_select
from pallas_kernels.shapes import F32, I32, S
from sparse_attn import methods
from sparse_attn.budget import Budget
from sparse_attn.kernels import RowBudget
from tests.sparse_attn.test_resa_decode_launches import LAYOUT, _export

BUDGETS = st.builds(
    Budget, budget=st.sampled_from((None, 0.05, 0.1, 0.3, 1.0, 40, 500)),
    p=st.sampled_from((0.1, 0.25)), n_min=st.sampled_from((0, 2)),
    n_sink=st.sampled_from((0, 4, 40)), local_window=st.sampled_from((0, 64, 100)),
    n_local=st.none() | st.integers(0, 3),
    forced_count=st.sampled_from(("extra", "inside")), min_tokens=st.sampled_from((0, 256)))


def _rows(rule, length, h):
  """The rule's ``(local_start, count)`` per batch row, repeated for its ``h`` heads."""
  start, count = rule(length)
  return jnp.repeat(start, h), jnp.repeat(count, h)


@settings(deadline=None, max_examples=12)
@given(b=st.integers(1, 3), h=st.sampled_from((1, 4)), nb=st.integers(1, 300),
       bs=st.sampled_from((1, 16)), budget=BUDGETS, seed=st.integers(0, 2**16))
def test_budgeted_lists_what_ranked_lists_from_the_rules_numbers(b, h, nb, bs, budget, seed):
  rng = np.random.default_rng(seed)
  rule = RowBudget(budget, nb, bs, min(budget.max_count(nb * bs, bs), nb))
  scores = jnp.asarray(rng.standard_normal((b, h, nb)), jnp.float32)
  length = jnp.asarray(rng.integers(0, nb * bs + 1, b), jnp.int32)
  kw = dict(n=rule.n_max, block_size=bs, n_sink_blocks=rule.sink)
  start, count = _rows(rule, length, h)
  want = block_select_ranked(scores.reshape(b * h, nb), count, jnp.repeat(length, h), start,
                             impl="pallas", interpret=True, **kw)
  for impl in ("pallas", "xla"):
    idx, n_valid = block_select_budgeted(scores, length, row_budget=rule, impl=impl,
                                         interpret=True, **kw)
    np.testing.assert_array_equal(n_valid, np.asarray(count).reshape(b, h))
    if impl == "pallas":
      np.testing.assert_array_equal(idx, np.asarray(want).reshape(b, h, -1))
    else:
      for r, c in enumerate(np.asarray(count)):  # lax.top_k's order: the same chosen set
        got, ref = np.asarray(idx).reshape(b * h, -1)[r, :c], np.asarray(want)[r, :c]
        assert sorted(got) == sorted(ref)


@settings(deadline=None, max_examples=5)
@given(shape=st.sampled_from([(1, 1, 37, 64, 16), (2, 2, 64, 64, 32)]), budget=BUDGETS,
       group=st.sampled_from((1, 4)), seed=st.integers(0, 2**16))
def test_score_select_with_the_rule_equals_it_with_the_numbers(shape, budget, group, seed):
  rng = np.random.default_rng(seed)
  b, k, nb, d, bs = shape
  lo, hi = (rng.standard_normal((b, k, nb, d)).astype(np.float32) for _ in range(2))
  kmin, kmax = jnp.asarray(np.minimum(lo, hi)), jnp.asarray(np.maximum(lo, hi))
  q = jnp.asarray(rng.standard_normal((b, k, group, d)), jnp.float32)
  length = jnp.asarray(rng.integers(0, nb * bs + 1, b), jnp.int32)
  rule = RowBudget(budget, nb, bs, min(budget.max_count(nb * bs, bs), nb))
  kw = dict(block_size=bs, n=rule.n_max, n_sink_blocks=rule.sink)
  for impl in ("pallas", "xla"):
    got = score_select(q, kmin, kmax, length, row_budget=rule, impl=impl, interpret=True, **kw)
    want = score_select(q, kmin, kmax, length, *rule(length), impl=impl, interpret=True, **kw)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g, w)


def test_counts_or_the_rule_not_both():
  rule = RowBudget(Budget(), 4, 16, 4)
  args = (jnp.zeros((1, 1, 16)), *(jnp.zeros((1, 1, 4, 16)),) * 2, jnp.full((1,), 64))
  kw = dict(block_size=16, n=4, n_sink_blocks=1, impl="xla")
  with pytest.raises(ValueError, match="not both"):
    score_select(*args, *rule(args[-1]), row_budget=rule, **kw)
  with pytest.raises(ValueError, match="not both"):
    score_select(*args, **kw)


@pytest.mark.parametrize("unit", (1, 16, 32, 64))
def test_fraction_count_is_the_float32_division_bit_for_bit(unit):
  """``ceil(budget * length * 2^-k)`` (no division inside a kernel) == the former
  ``ceil(budget * length / unit)`` in float32, at every length up to 2^20 tokens."""
  length = np.arange(1 << 20, dtype=np.int32)
  for frac in (0.025, 0.05, 0.1, 0.15, 0.3, 1 / 3, 0.5, 0.9, 1.0):
    tokens = np.float32(frac) * length.astype(np.float32)
    want = np.ceil(tokens / np.float32(unit)).astype(np.int32)
    got = np.asarray(Budget(budget=frac, n_sink=0, local_window=0).count(jnp.asarray(length),
                                                                          unit))
    np.testing.assert_array_equal(got, want, err_msg=f"{frac} / {unit}")


@pytest.mark.parametrize("budget", (Budget(budget=0.1), Budget(budget=None, p=0.1),
                                    Budget(budget=2048, n_local=2)))
def test_rule_compiles_for_sm90_without_approximate_division(budget, tmp_path):
  """(``ptx`` extra) 8192 blocks (128k, block 16): no ``div.approx`` (Triton's f32 division,
  which could round a count differently from XLA), no spill."""
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top
  rule = RowBudget(budget, 8192, 16, min(budget.max_count(131072, 16), 8192))
  fn = functools.partial(block_select_budgeted, row_budget=rule, n=rule.n_max, block_size=16,
                         n_sink_blocks=rule.sink, impl="pallas")
  [mod] = ptx.triton_modules(fn, S((1, 8, 8192), F32), S((1,), I32))
  kernel = ptx.compile_sm90(mod, str(tmp_path))
  assert "div.approx" not in kernel.asm["ptx"] and "div.full" not in kernel.asm["ptx"]
  usage = ptx.register_usage(kernel, str(tmp_path))
  assert usage["spill_bytes"] == 0 and usage["registers"] <= 255, usage


@pytest.mark.parametrize("spec", ("dense", "quest:gqa=group", "quest:gqa=group,fused=true"))
def test_decode_step_at_8b_128k_has_no_xla_arithmetic(spec):
  """The decode step (append, select, attend) at Llama-3.1-8B's shape, 131072 slots: every
  compute op is in a kernel, the padding rows' emptying included (the kernels read the rows'
  positions: ``query_pos``), so the step is its launches and layout ops."""
  kw = {} if spec == "dense" else dict(p=0.1, block_size=16)
  text = _export(methods.make(spec, impl="pallas", **kw), 131072)
  ops = collections.Counter(re.findall(r"= \"?stablehlo\.([a-z_]+)", text))
  assert {k: v for k, v in ops.items() if k not in LAYOUT} == {}
