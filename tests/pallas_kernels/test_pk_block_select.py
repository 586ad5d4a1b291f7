"""The sort-free top-k select (``pallas_kernels.block_select``): interpret mode chooses its
reference's set (``lax.top_k``'s) and lists it as a brute-force numpy select does, it lowers for
CUDA, and (with the ``ptx`` extra) compiles for sm_90 without register spills up to its row
limit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import block_select, block_select_ranked, block_select_reference
from pallas_kernels.block_select import (MAX_ENTRIES, block_select_phases, block_valid_forced,
                                         order_keys, rank_scores)
from pallas_kernels.shapes import F32, I32, S

FORCED = 3.0e38


def _ranked(rng, rows, nb, ties):
  """Scores like ``selection.rank_scores``'s: forced entries, entries past the context, ties."""
  s = rng.standard_normal((rows, nb)).astype(np.float32)
  if ties:
    s = np.round(s * 2) / 2 + 0.0  # few distinct values (and no -0.0)
  s[:, : rng.integers(0, 4)] = FORCED
  tail = rng.integers(0, nb // 2 + 1)
  if tail:
    s[:, nb - tail:] = -np.inf
  return s


def _np_select(s, count, n):
  """Brute force: per row the ``count`` best ids (ties: lower id first) ascending, then the
  other ids ascending, cut at ``n``."""
  keys = np.asarray(order_keys(jnp.asarray(s))).astype(np.int64)
  out = []
  for row, c in zip(keys, count):
    chosen = np.sort(np.argsort(-row, kind="stable")[:c])
    out.append(np.concatenate([chosen, np.setdiff1d(np.arange(len(row)), chosen)])[:n])
  return np.stack(out).astype(np.int32)


@settings(deadline=None, max_examples=15)
@given(rows=st.integers(1, 5), nb=st.integers(1, 700), ties=st.booleans(),
       bits=st.sampled_from((1, 2, 4, 8, "early")), data=st.data(), seed=st.integers(0, 2**16))
def test_interpret_chooses_the_reference_set_in_id_order(rows, nb, ties, bits, data, seed):
  """``bits="early"``: one bit a pass, stopping once exactly ``count`` keys are at or above."""
  rng = np.random.default_rng(seed)
  n = data.draw(st.integers(1, nb))
  s = _ranked(rng, rows, nb, ties)
  count = rng.integers(0, n + 1, rows).astype(np.int32)
  got = np.asarray(block_select(jnp.asarray(s), jnp.asarray(count), n=n, impl="pallas",
                                interpret=True, bits_per_pass=1 if bits == "early" else bits,
                                early_exit=bits == "early"))
  np.testing.assert_array_equal(got, _np_select(s, count, n))
  # the reference (lax.top_k: best first, ties lower id first) chooses the same set
  want = np.asarray(block_select_reference(jnp.asarray(s), jnp.asarray(count), n=n))
  for r in range(rows):
    c = int(count[r])
    assert sorted(got[r, :c].tolist()) == got[r, :c].tolist()  # ascending ids
    assert set(got[r, :c].tolist()) == set(want[r, :c].tolist())
    for ids in (got[r], want[r]):
      assert len(set(ids.tolist())) == n and ids.min() >= 0 and ids.max() < nb


def test_order_keys_keep_the_float_order():
  x = jnp.asarray([-np.inf, -3e38, -1.5, -1e-30, 0.0, 1e-30, 2.0, 3e38, np.inf], jnp.float32)
  k = np.asarray(order_keys(x)).astype(np.int64)
  assert np.all(np.diff(k) > 0)


def test_bits_per_pass_must_divide_the_key():
  with pytest.raises(ValueError, match="early_exit"):
    block_select(jnp.zeros((1, 8)), jnp.ones((1,), jnp.int32), n=2, impl="pallas",
                 interpret=True, bits_per_pass=2, early_exit=True)
  with pytest.raises(ValueError, match="bits_per_pass"):
    block_select(jnp.zeros((1, 8)), jnp.ones((1,), jnp.int32), n=2, impl="pallas",
                 interpret=True, bits_per_pass=3)


def test_rows_past_the_register_limit_take_the_reference():
  s = jnp.asarray(np.random.default_rng(0).standard_normal((1, MAX_ENTRIES + 1)), jnp.float32)
  got = block_select(s, jnp.asarray([5], jnp.int32), n=8, impl="pallas", interpret=True)
  np.testing.assert_array_equal(got, block_select_reference(s, jnp.asarray([5]), n=8))


@pytest.mark.parametrize("seed", range(3))
def test_timing_phases_do_what_they_leave_in(seed):
  """``block_select_phases`` (decode_sweep's parts of the kernel): ``all`` is ``block_select``;
  ``io`` and ``place`` split at the fixed key of 0.0, ``threshold`` at the count-th best score;
  without the placement each lane at or above the split writes its own id (when it is < n);
  the placement alone lists the entries >= 0.0, then the others."""
  rng = np.random.default_rng(seed)
  rows, nb, n = 3, 200, 150
  s = jnp.asarray(_ranked(rng, rows, nb, ties=seed == 2))
  count = jnp.asarray(rng.integers(120, n + 1, rows), jnp.int32)  # the count-th best is < 0
  run = lambda ph: np.asarray(block_select_phases(s, count, n=n, phases=ph, interpret=True))
  np.testing.assert_array_equal(run("all"), block_select(s, count, n=n, impl="pallas",
                                                         interpret=True))
  kth = np.sort(np.asarray(s), axis=1)[np.arange(rows), nb - np.asarray(count)]
  for ph, split in (("io", np.zeros(rows)), ("threshold", kth)):
    got, own = run(ph), np.asarray(s)[:, :n] >= split[:, None]
    np.testing.assert_array_equal(got[own], np.broadcast_to(np.arange(n), got.shape)[own])
  # the placement without the passes: the entries >= 0.0 first, then the others, in id order
  at_zero = np.asarray(s) >= 0
  want = [np.concatenate([np.flatnonzero(r), np.flatnonzero(~r)])[:n] for r in at_zero]
  np.testing.assert_array_equal(run("place"), np.stack(want))
  with pytest.raises(ValueError, match="phases"):
    block_select_phases(s, count, n=n, phases="loop", interpret=True)


@pytest.mark.parametrize("rows,nb,n,early", [(32, 8192, 410, False), (9, 256, 13, False),
                                             (14, 16384, 820, False), (32, 8192, 410, True)])
def test_lowers_for_cuda(rows, nb, n, early):
  fn = functools.partial(block_select, n=n, impl="pallas", early_exit=early)
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          S((rows, nb), F32), S((rows,), I32))
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()
  assert "sort" not in exported.mlir_module()  # no XLA sort anywhere in the selection


@pytest.mark.parametrize("phases", ("io", "threshold", "place"))
def test_timing_phases_lower_for_cuda(phases):
  fn = functools.partial(block_select_phases, n=820, phases=phases)
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          S((8, 8192), F32), S((8,), I32))
  assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("nb,early,ranked", [(2048, False, False), (8192, False, False),
                                             (MAX_ENTRIES, False, False), (8192, True, False),
                                             (8192, False, True), (MAX_ENTRIES, False, True)])
def test_compiles_for_sm90_without_spills(nb, early, ranked, tmp_path):
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top
  if ranked:
    fn = functools.partial(block_select_ranked, n=nb // 20, block_size=16, n_sink_blocks=1,
                           impl="pallas")
    rows = (S((32,), I32),) * 2
  else:
    fn, rows = functools.partial(block_select, n=nb // 20, impl="pallas", early_exit=early), ()
  [mod] = ptx.triton_modules(fn, S((32, nb), F32), S((32,), I32), *rows)
  kernel = ptx.compile_sm90(mod, str(tmp_path))
  assert 0 < kernel.metadata.shared <= ptx.H100_SMEM_PER_BLOCK
  usage = ptx.register_usage(kernel, str(tmp_path))
  assert usage["spill_bytes"] == 0 and usage["registers"] <= 255, usage


@settings(deadline=None, max_examples=12)
@given(rows=st.integers(1, 4), nb=st.integers(1, 300), bs=st.sampled_from((1, 16)),
       n_sink=st.integers(0, 3), local=st.integers(0, 4), nan=st.booleans(),
       data=st.data(), seed=st.integers(0, 2**16))
def test_ranked_lists_what_the_ranking_then_select_list(rows, nb, bs, n_sink, local, nan, data,
                                                        seed):
  """``block_select_ranked`` (raw scores; the valid and forced blocks from each row's length and
  local start) == ``rank_scores`` then ``block_select``, and its XLA path == the reference."""
  rng = np.random.default_rng(seed)
  n = data.draw(st.integers(1, nb))
  s = rng.standard_normal((rows, nb)).astype(np.float32)
  if nan:
    s[rng.random((rows, nb)) < 0.1] = np.nan
  length = rng.integers(0, nb * bs + 1, rows).astype(np.int32)
  start = np.maximum(-(-length // bs) - local, 0).astype(np.int32)
  count = rng.integers(0, n + 1, rows).astype(np.int32)
  args = tuple(jnp.asarray(x) for x in (s, count, length, start))
  kw = dict(n=n, block_size=bs, n_sink_blocks=n_sink)
  got = np.asarray(block_select_ranked(*args, impl="pallas", interpret=True, **kw))
  valid, forced = block_valid_forced(nb, args[2], args[3], bs, n_sink)
  ranked = rank_scores(args[0], valid, forced)
  want = np.asarray(block_select(ranked, args[1], n=n, impl="pallas", interpret=True))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(block_select_ranked(*args, impl="xla", **kw),
                                block_select_reference(ranked, args[1], n=n))


def test_ranked_lowers_for_cuda_without_masks_around_it():
  """At 128k's 8192 blocks the only ops over the blocks are the Triton call's."""
  fn = functools.partial(block_select_ranked, n=820, block_size=16, n_sink_blocks=1,
                         impl="pallas")
  text = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          S((8, 8192), F32), S((8,), I32), S((8,), I32), S((8,), I32)).mlir_module()
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert not [l for l in text.splitlines() if "stablehlo." in l and "8192" in l
              and "custom_call" not in l]
