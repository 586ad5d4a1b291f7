"""block_score / block_score_pooled: Pallas (interpret mode) == the jnp reference == Quest Eq. 1
evaluated literally (numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import (block_score, block_score_pooled, block_score_pooled_reference,
                            block_score_reference)

INTERPRET = True
# Both paths multiply exactly (bf16 x bf16 fits f32) and sum in float32 in different orders.
TOLS = {jnp.float32: (1e-4, 1e-5), jnp.bfloat16: (1e-3, 1e-4)}
reference = jax.jit(block_score_reference, static_argnames="block_size")
pooled_reference = jax.jit(block_score_pooled_reference, static_argnames="block_size")


def digests(rng, b, kh, nb, bs, d, dtype):
  """Keys and their real per-block channel min / max (so kmin <= kmax, as in the cache)."""
  k = rng.standard_normal((b, kh, nb, bs, d)).astype(np.float32)
  k = np.asarray(jnp.asarray(k, dtype).astype(jnp.float32))
  return k, jnp.asarray(k.min(axis=3), dtype), jnp.asarray(k.max(axis=3), dtype)


def check(got, want, dtype):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == np.float32 and not np.isnan(got).any()
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  live = np.isfinite(want)
  atol, rtol = TOLS[dtype]
  np.testing.assert_allclose(got[live], want[live], atol=atol, rtol=rtol)


F32, BF16 = jnp.float32, jnp.bfloat16
SHAPES = [  # batch, kv heads, group, head dim, block size, blocks, block_nb, dtype
    (1, 1, 1, 64, 16, 5, 16, F32),
    (2, 3, 3, 64, 16, 70, 32, BF16),
    (2, 2, 8, 128, 32, 33, 64, F32),
    (1, 2, 4, 128, 64, 16, 16, BF16),
    (2, 1, 2, 80, 32, 130, 64, BF16),  # D = 80: padded to 128 inside the kernel
    (1, 1, 20, 64, 16, 9, 16, BF16),  # G = 20: 32 query rows loaded, pooled to one
]


@settings(max_examples=15, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_reference(shape, seed):
  b, kh, g, d, bs, nb, block_nb, dtype = shape
  rng = np.random.default_rng(seed)
  _, kmin, kmax = digests(rng, b, kh, nb, bs, d, dtype)
  q = jnp.asarray(rng.standard_normal((b, kh, g, d)), dtype)
  length = jnp.asarray(rng.integers(0, nb * bs + 1, (b,)), jnp.int32)
  length = length.at[0].set(rng.choice([0, nb * bs, nb * bs - bs // 2]))
  kw = dict(block_size=bs, impl="pallas", interpret=INTERPRET, block_nb=block_nb)
  got = block_score(q, kmin, kmax, length, **kw)
  assert got.shape == (b, kh, g, nb)
  check(got, reference(q, kmin, kmax, length, block_size=bs), dtype)
  got = block_score_pooled(q, kmin, kmax, length, **kw)
  assert got.shape == (b, kh, nb)
  check(got, pooled_reference(q, kmin, kmax, length, block_size=bs), dtype)


def test_pooled_reference_scores_the_rounded_group_mean():
  """The pooled scores are those of ``scoring.pool_group``'s query (float32 mean rounded to
  the queries' dtype), which the Quest selector scored before the kernel pooled."""
  from sparse_attn import scoring  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(3)
  _, kmin, kmax = digests(rng, 2, 2, 7, 16, 64, BF16)
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 64)), BF16)
  length = jnp.asarray([112, 40], jnp.int32)
  pooled = scoring.pool_group(q.reshape(2, 8, 64), 2, "group")  # [B, K, D]
  want = reference(pooled[:, :, None], kmin, kmax, length, block_size=16)[:, :, 0]
  np.testing.assert_array_equal(pooled_reference(q, kmin, kmax, length, block_size=16), want)


def test_pooled_kernel_lowers_as_one_launch_with_no_xla_pooling():
  """Exported for CUDA (Llama-3.1-8B's heads, 128k, bf16): one Triton call and no XLA op
  on the queries (the mean is the kernel's)."""
  f = lambda *a: block_score_pooled(*a, block_size=16, impl="pallas")
  box = jax.ShapeDtypeStruct((1, 8, 8192, 128), BF16)
  call = "__gpu$xla.gpu.triton"
  text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
      jax.export.DisabledSafetyCheck.custom_call(call)])(
          jax.ShapeDtypeStruct((1, 8, 4, 128), BF16), box, box,
          jax.ShapeDtypeStruct((1,), jnp.int32)).mlir_module()
  assert text.count(f"custom_call @{call}") == 1
  for op in ("reduce", "divide", "add"):
    assert f"stablehlo.{op}" not in text, op


def test_reference_bounds_every_logit_and_masks_past_length():
  """Quest's guarantee: the score of a block >= q.k for every key in it."""
  rng = np.random.default_rng(0)
  k, kmin, kmax = digests(rng, 1, 2, 6, 16, 64, jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 2, 3, 64)), jnp.float32)
  length = jnp.asarray([70], jnp.int32)  # blocks 0..4 live (4 partially), block 5 not
  score = np.asarray(reference(q, kmin, kmax, length, block_size=16))
  # [B, K, G, NB, bs]
  logits = np.einsum("bkgd,bknsd->bkgns", np.asarray(q), k)
  assert (score[..., :5] >= logits.max(-1)[..., :5] - 1e-4).all()
  assert np.isneginf(score[..., 5]).all()


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reference_is_eq1_literally(dtype):
  """``relu(q) . kmax + min(q, 0) . kmin`` == ``sum_d max(q_d kmax_d, q_d kmin_d)`` (float64)."""
  rng = np.random.default_rng(2)
  _, kmin, kmax = digests(rng, 2, 2, 9, 16, 64, dtype)
  q = jnp.asarray(rng.standard_normal((2, 2, 3, 64)), dtype)
  length = jnp.asarray([144, 50], jnp.int32)
  qf, lo, hi = (np.asarray(x, np.float64) for x in (q, kmin, kmax))
  # [B, K, G, NB]
  want = np.maximum(qf[:, :, :, None] * hi[:, :, None], qf[:, :, :, None] * lo[:, :, None]).sum(-1)
  want[1, :, :, 4:] = -np.inf  # blocks starting at or past length 50
  check(reference(q, kmin, kmax, length, block_size=16), want, dtype)


def test_impl_dispatch():
  rng = np.random.default_rng(1)
  _, kmin, kmax = digests(rng, 1, 1, 4, 16, 64, jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 1, 2, 64)), jnp.float32)
  length = jnp.asarray([50], jnp.int32)
  want = reference(q, kmin, kmax, length, block_size=16)
  # "auto" is XLA on a CPU (exactly the reference there); on a GPU it is the kernel
  for impl in ("xla", "auto") if jax.default_backend() == "cpu" else ("xla",):
    np.testing.assert_allclose(block_score(q, kmin, kmax, length, block_size=16, impl=impl),
                               want, rtol=0 if jax.default_backend() == "cpu" else 1e-6)
  with pytest.raises(ValueError):
    block_score(q, kmin, kmax, length, block_size=16, impl="cuda")
