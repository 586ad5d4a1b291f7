"""dense_decode, the split-K kernel's identity mode: in interpret mode it returns exactly what
``sparse_decode`` returns over the explicit list of every block (``identity_lists``), and that
equals dense attention (the reference); rows of length 0 come back empty; it lowers for CUDA
with no list built around the Triton calls; with the ``ptx`` extra it compiles for sm_90
without spills."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import dense_decode, sparse_decode
from pallas_kernels.shapes import BF16, I32, S
from pallas_kernels.sparse_decode import identity_lists
from sparse_attn import reference as dense
from pk_testutil import assert_attention_close, pooled_cases


@settings(max_examples=12, deadline=None)
@given(case=pooled_cases(), holes=st.booleans(), softcap=st.sampled_from((None, 5.0)))
def test_identity_mode_equals_the_listed_kernel_and_dense_attention(case, holes, softcap):
  q, k, v, _, _, length, _ = case.arrays()
  rng = np.random.default_rng(case.seed)
  length = length.at[-1].set(0)  # an inactive row
  pos = None
  if holes:  # a compacted cache's empty slots
    p = np.broadcast_to(np.arange(case.t), (case.batch, case.hkv, case.t)).copy()
    p[rng.random(p.shape) < 0.2] = -1
    pos = jnp.asarray(p, jnp.int32)
  kw = dict(block_size=case.block_size, pos=pos, softcap=softcap, num_splits=case.num_splits,
            impl="pallas", interpret=True)
  out, lse = dense_decode(q, k, v, length, **kw)
  idx, nv = identity_lists(case.batch, case.hkv, case.num_blocks, length, case.block_size)
  want_out, want_lse = sparse_decode(q, k, v, idx, nv, length, **kw)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(lse, want_lse)
  assert np.all(np.isneginf(np.asarray(lse)[-1])) and not np.asarray(out[-1], np.float32).any()
  ref_out, ref_lse = dense_decode(q, k, v, length, **dict(kw, impl="xla"))
  assert_attention_close(out, lse, ref_out, ref_lse, case.dtype)
  d_out, d_lse = dense.attention(q[:, :, None], k, v, kv_length=length, k_positions=pos,
                                 softcap=softcap)
  assert_attention_close(out, lse, d_out[:, :, 0], d_lse[:, :, 0], case.dtype)


def _export(t: int):
  fn = functools.partial(dense_decode, block_size=16, impl="pallas")
  return jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
          S((1, 32, 128), BF16), S((1, 8, t, 128), BF16), S((1, 8, t, 128), BF16),
          S((1,), I32)).mlir_module()


def test_lowers_for_cuda_without_a_list():
  """At 128k (Llama-3.1-8B's attention shape): the kernel and its split combine, and no op
  builds the 8192-entry list."""
  text = _export(131072)
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert not [l for l in text.splitlines() if "stablehlo.iota" in l or (
      "stablehlo." in l and "8192" in l and "custom_call" not in l)]


def test_compiles_for_sm90_without_spills(tmp_path):
  pytest.importorskip("triton")
  from pallas_kernels import ptx  # pylint: disable=g-import-not-at-top
  fn = functools.partial(dense_decode, block_size=16, impl="pallas", num_stages=2)
  mods = ptx.triton_modules(fn, S((1, 32, 128), BF16), S((1, 8, 32768, 128), BF16),
                            S((1, 8, 32768, 128), BF16), S((1,), I32))
  for mod in mods:
    kernel = ptx.compile_sm90(mod, str(tmp_path))
    usage = ptx.register_usage(kernel, str(tmp_path))
    assert usage["spill_bytes"] == 0, (mod.name, usage)
