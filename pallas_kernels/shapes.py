"""Abstract inputs of every kernel at real model shapes (lowering tests, PTX checks, roofline).

Letters: B batch, N query heads, K kv heads, D head dim, T cache slots, n listed blocks, W window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

S = jax.ShapeDtypeStruct
I32, BF16, F32 = jnp.int32, jnp.bfloat16, jnp.float32

# name: (batch, N, K, D, T, block_size, listed blocks n)
MODELS = {
    "llama31_8b": (1, 32, 8, 128, 8192, 16, 26),
    "smollm2": (2, 9, 3, 64, 8192, 32, 13),
    # G = 16: no row padding at all (the unmasked load/store paths).
    "group16": (1, 32, 2, 128, 4096, 64, 8),
    # Qwen2.5 (G = 7) at 32k with a 5% budget.
    "qwen25_g7": (1, 14, 2, 64, 32768, 16, 102),
    "llama31_8b_32k": (1, 32, 8, 128, 32768, 16, 102),
}
# Token lists (entries of one slot: TidalDecode, RocketKV's stage 2, Twilight, the oracle
# top-k) through the decode kernels; same fields, block_size 1, n listed tokens (10% of 32k).
TOKEN_MODELS = {
    "llama31_8b_32k_tokens": (1, 32, 8, 128, 32768, 1, 3277),
}
TOKEN_KERNELS = [
    ("sparse_decode", False), ("sparse_decode", True), ("sparse_decode_resa", False),
    ("sparse_decode_resa", True), ("sparse_decode_multiquery", False),
]
WINDOW = 8
CHUNK = 512  # queries of a prefill / rectification chunk

# (kernel, per-head selection)
KERNELS = [
    ("block_score", False), ("block_score_pooled", False), ("sparse_decode", False),
    ("sparse_decode", True), ("sparse_decode_resa", False), ("sparse_decode_resa", True),
    ("sparse_decode_multiquery", False), ("sparse_decode_multiquery", True),
    ("sparse_decode_multiquery_resa", False), ("sparse_decode_multiquery_resa", True),
    ("chunk_attention", False),
]


def _multiquery(q, k, v, block_idx, n_valid, block_mask, q_limit, length, prior=None, **kw):
  """``sparse_decode_multiquery`` as RetroAttention's step runs it (the keys attended counted),
  with RESA's prior (RESA + retro) as an optional positional argument."""
  # pylint: disable-next=g-import-not-at-top
  from pallas_kernels.sparse_decode_multiquery import sparse_decode_multiquery
  return sparse_decode_multiquery(q, k, v, block_idx, n_valid, block_mask, q_limit, length,
                                  prior=prior, count_attended=True, **kw)


def _chunk_attention(*args, block_size: int, **kw):
  """``chunk_attention`` under the block-kernels' call (it reads no block lists)."""
  del block_size
  from pallas_kernels.chunk_attention import chunk_attention  # pylint: disable=g-import-not-at-top
  return chunk_attention(*args, **kw)


def kernel_avals(kernel: str, model: str, per_head: bool, dtype=BF16):
  """``(op, abstract args, block_size)`` of ``kernel`` at ``MODELS[model]``."""
  # pylint: disable=g-import-not-at-top (avoid a cycle: the ops import nothing from here)
  from pallas_kernels import block_score, block_score_pooled, sparse_decode, sparse_decode_resa
  b, hq, hkv, d, t, bs, n = {**MODELS, **TOKEN_MODELS}[model]
  hs = hq if per_head else hkv
  cache = S((b, hkv, t, d), dtype)
  lists = (S((b, hs, n), I32), S((b, hs), I32))
  length = S((b,), I32)
  if kernel in ("block_score", "block_score_pooled"):
    fn = {"block_score": block_score, "block_score_pooled": block_score_pooled}[kernel]
    digest = S((b, hkv, t // bs, d), dtype)
    return fn, (S((b, hkv, hq // hkv, d), dtype), digest, digest, length), bs
  if kernel == "chunk_attention":
    return _chunk_attention, (S((b, hq, CHUNK, d), dtype), cache, cache, S((b, CHUNK), I32),
                              S((b, hkv, t), I32), length), bs
  if kernel == "sparse_decode":
    return sparse_decode, (S((b, hq, d), dtype), cache, cache, *lists, length), bs
  if kernel == "sparse_decode_resa":
    return sparse_decode_resa, (S((b, hq, d), dtype), cache, cache, S((b, hq, t), F32), *lists,
                                length), bs
  multi = (S((b, hq, WINDOW, d), dtype), cache, cache, *lists,
           S((b, hs, WINDOW, n), jnp.bool_), S((b, WINDOW), I32), length)
  if kernel == "sparse_decode_multiquery_resa":
    return _multiquery, multi + (S((b, hq, t), F32),), bs
  if kernel != "sparse_decode_multiquery":
    raise ValueError(f"unknown kernel {kernel!r}; valid: {sorted({k for k, _ in KERNELS})}")
  return _multiquery, multi, bs
