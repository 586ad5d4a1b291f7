"""Causal flash attention of a query chunk over a KV cache: ``chunk_attention`` and its reference.

The dense paths of decoding (chunked prefill, ReSA's rectification, dense decode) attend ``S``
queries at token positions ``q_pos`` over a cache of ``T`` slots that holds ``length`` tokens.
The cache is static-capacity and may be compacted (slot order != position order, holes with
``pos = -1``), so causality is by position, not by index: query ``i`` sees slot ``j`` iff
``j < length``, ``0 <= k_pos[j] <= q_pos[i]`` (and ``k_pos[j] > q_pos[i] - window`` under a
sliding window). With ``softcap`` (Gemma 2) the scaled logits are soft-capped,
``cap * tanh(s / cap)`` (``softmax.soft_cap``), before the masks and the softmax, in the kernel
and the reference alike. ``jax.nn.dot_product_attention``'s causal mask is index-aligned and the Pallas
``mha`` op assumes ``S == T``, so neither states this contract in general; this kernel does.

Pallas path (flash attention, Dao et al. 2022, Alg. 1): one program per (batch, kv head, query
tile). Its rows are ``query_tile`` queries x the ``G`` query heads of the kv head (``G`` padded to
a power of 2), so every K/V tile is loaded once for the whole group (GQA packing, as the decode
kernels do). The loop over key tiles stops at the last tile that holds a key the tile's newest
query can see (``visible_tiles``: computed from the slots' smallest positions, so it is exact for
any slot order and bounded by the filled length), and ``num_stages >= 3`` keeps two K/V tiles in
flight. A small grid (a decode step: one query tile per kv head) also splits each query tile's
visible key tiles over ``key_splits`` programs (flash-decoding), merged by ``split_combine``.

In-order chunks (the Pallas path's ``in_order``): a prefill chunk over a cache whose slot ``j``
holds position ``j`` is two index-aligned attentions (the prefix, the chunk's own causal
block), which ``prompt_attention`` hands to cuDNN's fused flash attention on a GPU; one
``lax.cond`` on the traced state picks it or this kernel, so compacted caches, sliding windows,
soft-capped logits, f32 and short chunks keep the kernel.

Reference (the ``impl="xla"`` path, fast on CPU): the same schedule as XLA loops. A ``scan`` over
query tiles of ``query_tile`` rows keeps one tile's logits in cache through the matmul, the
softmax and the second matmul (2x faster than one big call on a 2-core CPU); per query tile a
``while_loop`` over key tiles of ``key_tile`` slots stops after the last tile holding a key the
tile can see (over the whole batch: one loop bound), combining the tiles online. A single query
(a decode step, where the loops cost more than they skip) or ``key_tile=None`` attends all ``T``
slots in one masked softmax.

Letters: B batch, N query heads, K kv heads, G = N // K, S queries, T slots, D head dim,
Q query tiles, NT key tiles, R rows of a program (query_tile x G padded).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import prompt_attention
from pallas_kernels.key_tiles import (NEVER, below_length, clamped_tile, seeable_positions,
                                     tile_first_positions, tiles_to_visit)
from pallas_kernels._decode_kernel import NEG_INF, _finish, _online_update
from pallas_kernels.softmax import check_softcap, default_scale, grouped_attention, soft_cap
from pallas_kernels.split_combine import split_combine
from pallas_kernels.backends import triton_module

plgpu = triton_module()  # jax.experimental.pallas.triton; see backends

# The reference's tiles (XLA:CPU): ~0.6 MB of logits per query tile at G = 3.
REF_KEY_TILE = 256
REF_QUERY_TILE = 128


def visibility(q_pos, k_pos, length, window: int | None = None):
  """``[B, K, S, T]`` bool: query ``i`` may attend slot ``j`` (the module's rule)."""
  # [B, K, 1, T]
  kp = seeable_positions(k_pos, below_length(length, k_pos.shape[-1]))[:, :, None, :]
  qp = q_pos[:, None, :, None]  # [B, 1, S, 1]
  see = kp <= qp
  if window is not None:
    see &= kp > qp - window
  return see


def chunk_attention_reference(q, k, v, q_pos, k_pos, length, *, scale: float | None = None,
                              window: int | None = None, key_tile: int | None = REF_KEY_TILE,
                              query_tile: int = REF_QUERY_TILE, softcap: float | None = None):
  """Plain-jnp causal attention by position (the ``impl="xla"`` path), tiled as the module
  docstring says; equals one masked softmax over every slot for any tile sizes.

  Args:
    q, k, v, q_pos, k_pos, length, scale, window, softcap: as ``chunk_attention``.
    key_tile: slots per key tile (``None``: one masked softmax over all ``T`` slots).
    query_tile: queries per query tile.

  Returns:
    ``out [B, N, S, D]`` in ``q.dtype`` and ``lse [B, N, S]`` float32.
  """
  if key_tile is not None and key_tile <= 0:
    raise ValueError(f"key_tile must be positive or None, got {key_tile}")
  if query_tile <= 0:
    raise ValueError(f"query_tile must be positive, got {query_tile}")
  softcap = check_softcap(softcap)
  b, n, s, d = q.shape
  kh, t = k.shape[1], k.shape[2]
  if key_tile is None or s == 1:
    ok = visibility(q_pos, k_pos, length, window)[:, :, None]  # [B, K, 1, S, T]
    out, lse = grouped_attention(q.reshape(b, kh, n // kh, s, d), k, v, ok, scale, softcap)
    return out.reshape(b, n, s, d), lse.reshape(b, n, s)
  key_tile = min(key_tile, t)
  # [B, K, T]: an unreachable position for slots that hold nothing to attend
  key_pos = seeable_positions(k_pos, below_length(length, t))
  first_pos = jnp.min(tile_first_positions(key_pos, key_tile), axis=(0, 1))  # [NT]
  qt = min(query_tile, s)
  nq = -(-s // qt)
  pad = nq * qt - s
  if pad:  # padded rows have position -1: they attend nothing and are cut off below
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
  # [Q, B, N, qt, D], [Q, B, qt]
  q_tiles = q.reshape(b, n, nq, qt, d).transpose(2, 0, 1, 3, 4)
  pos_tiles = q_pos.reshape(b, nq, qt).transpose(1, 0, 2)

  def one_query_tile(_, xs):
    qi, pi = xs
    return None, _attend_key_tiles(qi, pi, k, v, key_pos, first_pos, key_tile, scale, window,
                                   softcap)

  _, (out, lse) = lax.scan(one_query_tile, None, (q_tiles, pos_tiles))
  out = out.transpose(1, 2, 0, 3, 4).reshape(b, n, nq * qt, d)[:, :, :s]
  lse = lse.transpose(1, 2, 0, 3).reshape(b, n, nq * qt)[:, :, :s]
  return out, lse


def _attend_key_tiles(q, q_pos, k, v, key_pos, first_pos, key_tile: int, scale, window,
                      softcap=None):
  """One query tile ``q [B, N, qt, D]`` at ``q_pos [B, qt]`` over the key tiles it can see.

  Flash attention's online softmax (Dao et al. 2022, Alg. 1): a running row max ``m``, sum
  ``l`` and unnormalised output, rescaled by ``exp(m_old - m_new)`` per key tile.

  Args:
    k, v: ``[B, K, T, D]``; key_pos: ``[B, K, T]`` slot positions (``NEVER``: not
      attendable); first_pos: ``[NT]`` smallest position of each key tile.

  Returns:
    ``out [B, N, qt, D]`` in ``q.dtype`` and ``lse [B, N, qt]`` float32.
  """
  b, n, qt, d = q.shape
  kh = k.shape[1]
  g = n // kh
  scale = default_scale(d, scale)
  num_tiles = tiles_to_visit(first_pos, jnp.max(q_pos))
  qp = jnp.where(q_pos >= 0, q_pos, -1)[:, None, None, :, None]  # [B, 1, 1, qt, 1]
  qg = (q.astype(jnp.float32) * scale).reshape(b, kh, g * qt, d)  # [B, K, G*qt, D]
  exact = dict(preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

  def tile(i, carry):
    acc, m, l = carry
    start, kp = clamped_tile(key_pos, i, key_tile)
    take = lambda x: lax.dynamic_slice_in_dim(x, start, key_tile, axis=2)
    see = kp[:, :, None, None, :] <= qp  # [B, K, 1, qt, kt]
    if window is not None:
      see &= kp[:, :, None, None, :] > qp - window
    # [B, K, G, qt, kt]
    logits = jnp.einsum("bkmd,bktd->bkmt", qg, take(k), **exact).reshape(b, kh, g, qt, key_tile)
    logits = jnp.where(see, soft_cap(logits, softcap), NEG_INF)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(logits - m_safe[..., None])
    rescale = jnp.exp(m - m_safe)  # 0 while m = -inf
    l = l * rescale + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkmt,bktd->bkmd", p.reshape(b, kh, g * qt, key_tile),
                    take(v).astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return acc * rescale[..., None] + pv.reshape(b, kh, g, qt, d), m_new, l

  init = (jnp.zeros((b, kh, g, qt, d), jnp.float32),
          jnp.full((b, kh, g, qt), NEG_INF, jnp.float32), jnp.zeros((b, kh, g, qt), jnp.float32))
  acc, m, l = lax.fori_loop(0, num_tiles, tile, init)
  seen = l > 0
  safe_l = jnp.where(seen, l, 1.0)
  out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(safe_l), NEG_INF)
  return out.reshape(b, n, qt, d).astype(q.dtype), lse.reshape(b, n, qt)


def visible_tiles(q_pos, k_pos, length, *, query_tile: int, key_tile: int):
  """``[B, K, Q]`` int32: key tiles a query tile visits (tiles ``0..count-1``).

  A key tile is needed iff one of its filled slots holds a position at or before the tile's
  newest query; the count is one past the last such tile (exact for any slot order).
  """
  b, t = k_pos.shape[0], k_pos.shape[2]
  s = q_pos.shape[1]
  nq = -(-s // query_tile)
  # [B, K, NT]
  first = tile_first_positions(seeable_positions(k_pos, below_length(length, t)), key_tile)
  qp = jnp.pad(q_pos, ((0, 0), (0, nq * query_tile - s)), constant_values=-1)
  newest = jnp.max(qp.reshape(b, nq, query_tile), axis=-1)  # [B, Q]
  return tiles_to_visit(first[:, :, None, :], newest[:, None, :])


def _chunk_kernel(q_ref, qpos_ref, k_ref, v_ref, kpos_ref, length_ref, tiles_ref, o_ref, lse_ref,
                  *, scale: float, rows: int, head_dim: int, key_tile: int, num_slots: int,
                  window: int | None, splits: int, softcap: float | None = None):
  """One (batch, kv head, query tile, split) program: ``rows`` query rows over its share of the
  visible key tiles (split ``i`` of ``splits`` takes the ``i``-th run of ``ceil(tiles / splits)``
  tiles; an empty share leaves ``0`` / ``-inf``)."""
  dp = _common.pad_rows(head_dim)
  col = jnp.arange(dp)
  col_ok = col < head_dim
  cols_at = pl.ds(0, dp)
  q = plgpu.load(q_ref.at[:, cols_at], mask=col_ok[None, :], other=0)
  cdt = jnp.promote_types(q_ref.dtype, k_ref.dtype)
  precision = lax.Precision.HIGHEST if cdt == jnp.float32 else None
  q = q.astype(cdt)
  qpos = qpos_ref[...]  # [R]; -1 for padding rows (they see nothing)
  length = length_ref[()]
  offsets = jnp.arange(key_tile)

  def body(j, carry):
    slots = j * key_tile + offsets
    filled = (slots < num_slots) & (slots < length)
    at = (slots[:, None], col[None, :])
    kv_mask = filled[:, None] & col_ok[None, :]
    k = plgpu.load(k_ref.at[at], mask=kv_mask, other=0).astype(cdt)
    v = plgpu.load(v_ref.at[at], mask=kv_mask, other=0)
    if cdt == jnp.float32:
      v = v.astype(cdt)
    kp = plgpu.load(kpos_ref.at[slots], mask=filled, other=-1)
    kp = jnp.where(kp >= 0, kp, NEVER)
    see = kp[None, :] <= qpos[:, None]  # [R, key_tile]
    if window is not None:
      see &= kp[None, :] > qpos[:, None] - window
    s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * scale
    return _online_update(carry, jnp.where(see, soft_cap(s, softcap), NEG_INF), v, precision)

  init = (jnp.zeros((rows, dp), jnp.float32), jnp.full((rows,), NEG_INF, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  tiles = tiles_ref[()]
  per = (tiles + splits - 1) // splits
  lo = pl.program_id(3) * per
  out, lse = _finish(lax.fori_loop(lo, jnp.minimum(lo + per, tiles), body, init))
  if dp != head_dim:
    plgpu.store(o_ref.at[:, cols_at], out, mask=col_ok[None, :])
  else:
    o_ref[...] = out
  lse_ref[...] = lse


# Programs a GPU wants in flight (~2 per SM of an H100's 132): a grid smaller than this splits
# its key tiles (a decode step has one query tile per kv head: 8 programs for Llama-8B).
TARGET_PROGRAMS = 256
MAX_KEY_SPLITS = 32


def default_key_splits(programs: int, key_tiles: int) -> int:
  """Splits per query tile so ``programs x splits`` reaches ``TARGET_PROGRAMS`` (static)."""
  want = -(-TARGET_PROGRAMS // max(programs, 1))
  return max(1, min(want, key_tiles, MAX_KEY_SPLITS))


def in_order_implementation(in_order: str | None, dtype, s: int, d: int,
                            window: int | None) -> str | None:
  """Which ``jax.nn.dot_product_attention`` implementation the Pallas path hands an in-order
  chunk to (``prompt_attention``), or None for its own kernel. ``"auto"``: cuDNN on a GPU
  backend for a 16-bit chunk of at least ``MIN_QUERIES`` queries, ``D <= 128`` a multiple of
  8, no sliding window; ``"cudnn"`` / ``"xla"``: that implementation whenever there is no
  window; None: never."""
  if in_order is None or window is not None:
    return None
  if in_order in ("cudnn", "xla"):
    return in_order
  if in_order != "auto":
    raise ValueError(f"in_order must be 'auto', 'cudnn', 'xla' or None, got {in_order!r}")
  sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if (jax.default_backend() == "gpu" and sixteen_bit and s >= prompt_attention.MIN_QUERIES
      and d <= 128 and d % 8 == 0 and prompt_attention.cudnn_compiles(jnp.dtype(dtype).name, d)):
    return "cudnn"
  return None


@functools.partial(jax.jit, static_argnames=("scale", "window", "query_tile", "key_tile",
                                             "key_splits", "impl", "interpret", "num_warps",
                                             "num_stages", "in_order", "softcap"))
def chunk_attention(q, k, v, q_pos, k_pos, length, *, scale: float | None = None,
                    window: int | None = None, query_tile: int | None = None,
                    key_tile: int = 64, key_splits: int | None = None,
                    impl: _common.Impl = "auto", interpret: bool = False, num_warps: int = 4,
                    num_stages: int = 3, in_order: str | None = "auto",
                    softcap: float | None = None):
  """Exact causal attention of a query chunk over a cache, by token position.

  Args:
    q: ``[B, N, S, D]`` queries.
    k, v: ``[B, K, T, D]`` cache (``N`` a multiple of ``K``).
    q_pos: ``[B, S]`` int32 query positions (negative = padding: attends nothing).
    k_pos: ``[B, K, T]`` int32 position held by each slot (-1 = empty).
    length: ``[B]`` int32; slots ``>= length`` are never attended.
    scale: softmax scale (static), default ``1/sqrt(D)``.
    window: sliding-window length (static; None = full causal attention).
    query_tile: queries per program (static, a power of 2), default 64 rows a program
      (``64 // G'`` queries, ``G'`` = G padded to a power of 2), fewer for a short chunk but
      always >= 16 rows (``tl.dot``'s minimum).
    key_tile: slots per loop iteration (static, a power of 2 >= 16).
    key_splits: programs sharing one query tile's key tiles (static; flash-decoding, merged by
      ``split_combine``). None: enough splits for ~``TARGET_PROGRAMS`` programs when the grid
      is small (a decode step: one query tile per kv head), 1 for a long chunk.
    impl: ``"pallas"``, ``"xla"`` (``chunk_attention_reference``) or ``"auto"``.
    interpret: run the Pallas kernel in interpret mode (CPU).
    num_warps, num_stages: Triton launch parameters.
    in_order: the Pallas path's handling of a chunk that meets an in-order cache (a prefill
      chunk before any compaction: ``prompt_attention``): ``"auto"`` (cuDNN's flash attention
      on a GPU for a long 16-bit chunk, ``in_order_implementation``), ``"cudnn"``, ``"xla"``
      or None (always the kernel). The state is checked on the traced arrays; any other chunk
      runs the kernel. A soft-capped chunk always runs the kernel (the library attentions have
      no soft-cap).
    softcap: attention-logit soft-cap (static; Gemma 2's ``s -> cap * tanh(s / cap)`` on the
      scaled logits, ``softmax.soft_cap``), None = none.

  The tile arguments are the kernel's; the reference runs with its own (``REF_KEY_TILE``,
  ``REF_QUERY_TILE``).

  Returns:
    ``out [B, N, S, D]`` in ``q.dtype`` and ``lse [B, N, S]`` float32 (``0`` and ``-inf`` for a
    query that sees nothing).
  """
  b, n, s, d = q.shape
  kh, t = k.shape[1], k.shape[2]
  if n % kh:
    raise ValueError(f"{n} query heads are not a multiple of {kh} kv heads")
  if key_tile < 16 or key_tile & (key_tile - 1):
    raise ValueError(f"key_tile must be a power of 2 >= 16, got {key_tile}")
  if _common.resolve_impl(impl, "chunk_attention") == "xla":
    return chunk_attention_reference(q, k, v, q_pos, k_pos, length, scale=scale, window=window,
                                     softcap=softcap)
  softcap = check_softcap(softcap)
  kernel = functools.partial(
      _chunk_attention_kernel, q, k, v, q_pos, k_pos, length, scale=scale, window=window,
      query_tile=query_tile, key_tile=key_tile, key_splits=key_splits, interpret=interpret,
      num_warps=num_warps, num_stages=num_stages, softcap=softcap)
  library = None if softcap is not None else in_order_implementation(in_order, q.dtype, s, d,
                                                                     window)
  if library is None:
    return kernel()
  ok, start = prompt_attention.in_order_start(q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                                              length.astype(jnp.int32), t)
  return lax.cond(ok, lambda: prompt_attention.in_order_attention(
      q, k, v, q_pos, length, start, scale=scale, implementation=library), kernel)


def _chunk_attention_kernel(q, k, v, q_pos, k_pos, length, *, scale, window, query_tile,
                            key_tile, key_splits, interpret, num_warps, num_stages,
                            softcap=None):
  """``chunk_attention``'s Pallas kernel (the docstring's flash attention) and its combine."""
  b, n, s, d = q.shape
  kh, t = k.shape[1], k.shape[2]
  g = n // kh
  gp = _common.next_pow2(g)
  qt = query_tile or max(_common.next_pow2(min(s, max(1, 64 // gp))), max(1, 16 // gp))
  if qt & (qt - 1):
    raise ValueError(f"query_tile must be a power of 2, got {qt}")
  nq = -(-s // qt)
  sp = nq * qt
  # Rows ordered (query, head) so a query tile is one contiguous run of qt * gp rows; padded
  # heads and queries carry position -1.
  qr = q.reshape(b, kh, g, s, d).transpose(0, 1, 3, 2, 4)  # [B, K, S, G, D]
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, sp - s), (0, gp - g), (0, 0))).reshape(b, kh, sp * gp, d)
  qp = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, sp - s)), constant_values=-1)
  rpos = jnp.where(jnp.arange(gp)[None, None, :] < g, qp[:, :, None], -1).reshape(b, sp * gp)
  tiles = visible_tiles(q_pos.astype(jnp.int32), k_pos.astype(jnp.int32),
                        length.astype(jnp.int32), query_tile=qt, key_tile=key_tile)
  r = qt * gp
  ns = key_splits or default_key_splits(b * kh * nq, -(-t // key_tile))
  if ns < 1:
    raise ValueError(f"key_splits must be >= 1, got {ns}")
  kernel = functools.partial(_chunk_kernel, scale=default_scale(d, scale), rows=r, head_dim=d,
                             key_tile=key_tile, num_slots=t, window=window, splits=ns,
                             softcap=softcap)
  kv = pl.BlockSpec((None, None, t, d), lambda bi, hi, qi, si: (bi, hi, 0, 0))
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, kh, nq, ns),
      in_specs=[
          pl.BlockSpec((None, None, r, d), lambda bi, hi, qi, si: (bi, hi, qi, 0)),
          pl.BlockSpec((None, r), lambda bi, hi, qi, si: (bi, qi)),
          kv, kv,
          pl.BlockSpec((None, None, t), lambda bi, hi, qi, si: (bi, hi, 0)),
          pl.BlockSpec((None,), lambda bi, hi, qi, si: (bi,)),
          pl.BlockSpec((None, None, None), lambda bi, hi, qi, si: (bi, hi, qi)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, r, d), lambda bi, hi, qi, si: (bi, hi * nq + qi, si, 0,
                                                                         0)),
          pl.BlockSpec((None, None, None, r), lambda bi, hi, qi, si: (bi, hi * nq + qi, si, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, kh * nq, ns, r, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh * nq, ns, r), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="chunk_attention",
  )(qr, rpos, k, v, k_pos.astype(jnp.int32), length.astype(jnp.int32), tiles)
  out, lse = split_combine(out, lse, impl="pallas", interpret=interpret)  # [B, K*Q, R, ...]
  out = out.reshape(b, kh, sp, gp, d)[:, :, :s, :g].transpose(0, 1, 3, 2, 4)
  lse = lse.reshape(b, kh, sp, gp)[:, :, :s, :g].transpose(0, 1, 3, 2)
  return out.reshape(b, n, s, d).astype(q.dtype), lse.reshape(b, n, s)
