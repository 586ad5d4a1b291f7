"""Every kernel lowers for CUDA through Triton on this GPU-less machine (jax.export).

Only the custom-call compatibility check of the Triton call target is disabled; the export still
runs the whole Pallas -> Triton IR lowering, which is where power-of-2 shapes, dtypes and
unsupported ops fail.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (block_score, block_score_pooled, sparse_decode,
                            sparse_decode_multiquery, sparse_decode_resa)

TRITON_CALL = "__gpu$xla.gpu.triton"
S = jax.ShapeDtypeStruct
I32, BF16, F32 = jnp.int32, jnp.bfloat16, jnp.float32

# name: (batch, Hq, Hkv, D, T, block_size, listed blocks)
MODELS = {
    "llama31_8b": (1, 32, 8, 128, 8192, 16, 26),
    "smollm2": (2, 9, 3, 64, 8192, 32, 13),
    # G = 16: no row padding at all (the unmasked load/store paths).
    "group16": (1, 32, 2, 128, 4096, 64, 8),
}
WINDOW = 8


def export_cuda(fn, *avals) -> str:
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*avals)
  return exported.mlir_module()


def kernel_avals(kernel, model, per_head):
  b, hq, hkv, d, t, bs, n = MODELS[model]
  hs = hq if per_head else hkv
  cache = S((b, hkv, t, d), BF16)
  lists = (S((b, hs, n), I32), S((b, hs), I32))
  length = S((b,), I32)
  if kernel in ("block_score", "block_score_pooled"):
    fn = {"block_score": block_score, "block_score_pooled": block_score_pooled}[kernel]
    digest = S((b, hkv, t // bs, d), BF16)
    return fn, (S((b, hkv, hq // hkv, d), BF16), digest, digest, length)
  if kernel == "sparse_decode":
    return sparse_decode, (S((b, hq, d), BF16), cache, cache, *lists, length)
  if kernel == "sparse_decode_resa":
    return sparse_decode_resa, (S((b, hq, d), BF16), cache, cache, S((b, hq, t), F32), *lists,
                                length)
  assert kernel == "sparse_decode_multiquery"
  return sparse_decode_multiquery, (S((b, hq, WINDOW, d), BF16), cache, cache, *lists,
                                    S((b, hs, WINDOW, n), jnp.bool_), S((b, WINDOW), I32),
                                    length)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("kernel,per_head", [
    ("block_score", False), ("block_score_pooled", False), ("sparse_decode", False),
    ("sparse_decode", True), ("sparse_decode_resa", False), ("sparse_decode_resa", True),
    ("sparse_decode_multiquery", False), ("sparse_decode_multiquery", True),
])
def test_lowers_for_cuda(kernel, per_head, model):
  fn, avals = kernel_avals(kernel, model, per_head)
  bs = MODELS[model][5]
  text = export_cuda(functools.partial(fn, block_size=bs, impl="pallas"), *avals)
  targets = set(re.findall(r"custom_call @([\w$.]+)", text))
  assert targets == {TRITON_CALL}, targets


def test_non_power_of_two_head_dim_and_f32_lower():
  """D = 80 is padded inside the kernel; f32 takes the IEEE (not tf32) dot path."""
  b, hq, hkv, d, t, bs, n = 1, 6, 2, 80, 1024, 16, 9
  for dtype in (F32, BF16):
    cache = S((b, hkv, t, d), dtype)
    text = export_cuda(functools.partial(sparse_decode, block_size=bs, impl="pallas"),
                       S((b, hq, d), dtype), cache, cache, S((b, hkv, n), I32),
                       S((b, hkv), I32), S((b,), I32))
    assert TRITON_CALL in text
