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

from pallas_kernels import sparse_decode

from pallas_kernels.shapes import (BF16, F32, I32, KERNELS, MODELS, S, TOKEN_KERNELS,
                                   TOKEN_MODELS, kernel_avals)

TRITON_CALL = "__gpu$xla.gpu.triton"


def export_cuda(fn, *avals) -> str:
  exported = jax.export.export(
      jax.jit(fn), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*avals)
  return exported.mlir_module()


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("kernel,per_head", KERNELS)
def test_lowers_for_cuda(kernel, per_head, model):
  fn, avals, bs = kernel_avals(kernel, model, per_head)
  text = export_cuda(functools.partial(fn, block_size=bs, impl="pallas"), *avals)
  targets = set(re.findall(r"custom_call @([\w$.]+)", text))
  assert targets == {TRITON_CALL}, targets


@pytest.mark.parametrize("model", sorted(TOKEN_MODELS))
@pytest.mark.parametrize("kernel,per_head", TOKEN_KERNELS)
def test_token_lists_lower_for_cuda(kernel, per_head, model):
  """Lists of single slots (block_size 1) through the same Triton kernels."""
  fn, avals, bs = kernel_avals(kernel, model, per_head)
  assert bs == 1
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


def test_resa_with_its_aggregator_in_the_combine_lowers():
  """The RESA op with ``resa.Aggregator`` as the split combine's epilogue: two Triton calls
  (decode, combine) and no XLA aggregation after them (Llama-3.1-8B heads, 32k)."""
  from pallas_kernels import sparse_decode_resa  # pylint: disable=g-import-not-at-top
  from sparse_attn.enhancers import resa  # pylint: disable=g-import-not-at-top
  b, hq, hkv, d, t, bs, n = 1, 32, 8, 128, 32768, 16, 205
  cache = S((b, hkv, t, d), BF16)
  fn = functools.partial(sparse_decode_resa, block_size=bs, impl="pallas", num_splits=4,
                         epilogue=resa.Aggregator(1.0))
  text = export_cuda(lambda *a: fn(*a[:7], extras=a[7:]), S((b, hq, d), BF16), cache, cache,
                     S((b, hq, t), F32), S((b, hkv, n), I32), S((b, hkv), I32), S((b,), I32),
                     S((b, hq, d), F32), S((b, hq), F32), S((b, hq), F32), S((b, hq), I32))
  assert text.count(f"custom_call @{TRITON_CALL}") == 2
  assert "stablehlo.exponential" not in text and "stablehlo.log" not in text


def test_chunk_attention_with_its_in_order_branch_lowers():
  """A 4096-query bf16 prefill chunk of the Llama-8B heads over a 32k cache: the kernel branch
  and the in-order branch (here XLA's dot_product_attention: cuDNN's cannot be traced without
  a GPU) under one conditional."""
  from pallas_kernels import chunk_attention  # pylint: disable=g-import-not-at-top
  b, hq, hkv, d, t, s = 1, 32, 8, 128, 32768, 4096
  cache = S((b, hkv, t, d), BF16)
  text = export_cuda(functools.partial(chunk_attention, impl="pallas", in_order="xla"),
                     S((b, hq, s, d), BF16), cache, cache, S((b, s), I32), S((b, hkv, t), I32),
                     S((b,), I32))
  assert f"custom_call @{TRITON_CALL}" in text and "stablehlo.case" in text


def test_softcapped_decode_and_chunk_kernels_lower():
  """Gemma 2's attention-logit soft-cap (tanh in the kernels) at Gemma-2-9B's heads (16 query,
  8 kv, D = 256): the decode kernel, its multi-query form and the chunk kernel lower, and a
  soft-capped chunk has no in-order (library) branch."""
  from pallas_kernels import chunk_attention, sparse_decode_multiquery  # pylint: disable=g-import-not-at-top
  b, hq, hkv, d, t, bs, n, s = 1, 16, 8, 256, 8192, 16, 26, 256
  cache = S((b, hkv, t, d), BF16)
  text = export_cuda(functools.partial(sparse_decode, block_size=bs, impl="pallas",
                                       softcap=50.0),
                     S((b, hq, d), BF16), cache, cache, S((b, hkv, n), I32), S((b, hkv), I32),
                     S((b,), I32))
  assert TRITON_CALL in text and "tanh" in text
  text = export_cuda(functools.partial(sparse_decode_multiquery, block_size=bs, impl="pallas",
                                       softcap=50.0),
                     S((b, hq, 4, d), BF16), cache, cache, S((b, hkv, n), I32),
                     S((b, hkv), I32), S((b, hkv, 4, n), jnp.bool_), S((b, 4), I32),
                     S((b,), I32))
  assert TRITON_CALL in text
  text = export_cuda(functools.partial(chunk_attention, impl="pallas", in_order="xla",
                                       softcap=50.0),
                     S((b, hq, s, d), BF16), cache, cache, S((b, s), I32), S((b, hkv, t), I32),
                     S((b,), I32))
  assert f"custom_call @{TRITON_CALL}" in text and "stablehlo.case" not in text
