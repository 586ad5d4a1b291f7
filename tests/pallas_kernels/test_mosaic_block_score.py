"""Mosaic GPU block_score == block_score_reference under Mosaic GPU's interpret mode (race
detection on), and its lowering for CUDA (jax.export)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from pallas_kernels.mosaic import InterpretGPUParams, block_score
from test_pk_block_score import F32, BF16, check, digests, reference

PARAMS = InterpretGPUParams(detect_races=True)
SHAPES = [  # batch, kv heads, group, head dim, block size, blocks, dtype
    (1, 1, 1, 64, 16, 5, F32),
    (2, 1, 3, 64, 16, 70, BF16),  # two 64-block tiles, the second partly padded
    (1, 2, 2, 80, 32, 130, F32),  # D = 80 padded to 128; three tiles over two splits
]


@settings(max_examples=5, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**31 - 1))
def test_matches_reference(shape, seed):
  b, kh, g, d, bs, nb, dtype = shape
  rng = np.random.default_rng(seed)
  _, kmin, kmax = digests(rng, b, kh, nb, bs, d, dtype)
  q = jnp.asarray(rng.standard_normal((b, kh, g, d)), dtype)
  length = jnp.asarray(rng.integers(0, nb * bs + 1, (b,)), jnp.int32)
  length = length.at[0].set(rng.choice([0, nb * bs, nb * bs - bs // 2]))
  gpu_callbacks.reset_gpu_interpret_mode_state()
  got = jax.block_until_ready(
      block_score(q, kmin, kmax, length, block_size=bs, impl="mosaic", interpret=PARAMS))
  assert not gpu_callbacks.get_races().races_found
  assert got.shape == (b, kh, g, nb)
  check(got, reference(q, kmin, kmax, length, block_size=bs), dtype)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda(dtype):
  """Llama-3.1-8B heads, 32k tokens in 16-token blocks (2048 digests per kv head)."""
  fn = functools.partial(block_score, block_size=16, impl="mosaic")
  text = jax.export.export(jax.jit(fn), platforms=["cuda"])(
      S((1, 8, 4, 128), dtype), S((1, 8, 2048, 128), dtype), S((1, 8, 2048, 128), dtype),
      S((1,), jnp.int32)).mlir_module()
  assert "custom_call @mosaic_gpu_v2" in text
