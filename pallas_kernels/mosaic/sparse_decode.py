"""Sparse flash-decoding over a block list on Mosaic GPU (Hopper): ``sparse_decode``.

The Mosaic GPU twin of ``pallas_kernels.sparse_decode`` (same signature, same reference,
``sparse_decode_reference``; dense decoding is the list of every block). One program (one
warpgroup) per (batch, kv head, split) walks its slice of the kv head's list:

  * each pipeline step gathers ``J = W / block_size`` listed blocks into one ``[W, D]`` K tile
    and one V tile in shared memory (``W = max(64, block_size)`` tokens unless
    ``tokens_per_step`` says otherwise), one TMA bulk copy per block and tensor
    (``plgpu.copy_gmem_to_smem``), each completing on its own mbarrier;
  * a ring of ``num_stages`` such tiles keeps ``num_stages - 1`` steps of copies in flight while
    one is computed: step ``i`` waits for its slot's barriers, computes, then issues step
    ``i + num_stages`` into the slot it just freed (``plgpu.emit_pipeline``'s order);
  * with 16-bit caches (``mma_usable``) a step's two products are WGMMAs on the tensor cores,
    as in flash attention: the group's R (<= 64) query rows padded to one 64-row tile in SMEM,
    ``S = Q K^T`` ``[64, W]`` into a float32 accumulator, the online softmax per tile row
    (row reductions stay inside a warp in the WGMMA layout), ``acc += P V`` with the 16-bit
    ``P`` from registers. The padding costs tensor-core work a decode step has to spare (two
    ``64 x W x D`` products per 2 W D bytes read); it removes the per-row loop and the
    cross-warp reduction over the tile's tokens that ``p . v`` needs on CUDA cores;
  * otherwise (f32 caches, which a WGMMA would round to TF32, and the multi-query variant)
    the compute is on CUDA cores in float32 per row: ``s = sum_d k * q`` (a row
    reduction of the WGMMA-layout tile), the online softmax, and ``acc += sum_t p * v`` (a
    column reduction).

Per-query-head lists run over the union of the group's lists (``_union.union_head_bits``) with a
per-(entry, row) bit, as the Triton kernel does; the split partials are merged by
``lse_combine`` (XLA). Block sizes: powers of 2 >= 16; head dims: multiples of 64 (bf16/f16) or
32 (f32) elements (whole 128-byte swizzled rows).

The same body runs RESA's variant (``mosaic.sparse_decode_resa``, ``with_prior``): a third
ring holds each step's ``[R, W]`` prior logits of the listed slots. On the WGMMA step they fill
the tile's free rows (row ``R + r``: query row ``r``'s prior), so the same softmax and ``P V``
accumulate the prior pair; on CUDA cores each row runs a second online softmax of its prior
over the attended members with the same V tile. Both count the members attended.

And RetroAttention's multi-query variant (``mosaic.sparse_decode_multiquery``, ``with_limit``):
R = G x window rows (each head's window queries), each with its own last position
(``row_limit``; with ``pos`` each step's listed-slot positions come by TMA into a fourth ring),
per-(entry, row) bits over several words, and one prior row per head shared by its queries.

Letters: B batch, N query heads, K kv heads, G = N // K, R rows of a program (G; G x window for
the multi-query), n list length, S splits, T slots, D head dim, W tokens per step, J blocks per
step.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.mosaic import _common as mc
from pallas_kernels.mosaic._decode_body import decode_body
from pallas_kernels.softmax import check_softcap, default_scale, lse_combine
from pallas_kernels.split_combine import split_combine_pairs
from pallas_kernels.sparse_decode import (checked_lists, gather_prior, identity_lists,
                                          selection_rows, sparse_decode_reference)

NEG_INF = mc.NEG_INF
# Mosaic GPU allocates at most 32 barriers per group (one group per tensor: J x stages).
MAX_BARRIERS = 32


def mma_usable(q_dtype, k_dtype, v_dtype, *, w: int, d: int, with_limit: bool,
               with_prior: bool, rows: int = 1) -> bool:
  """Whether a step's products can run as WGMMAs: q, k, v of one 16-bit dtype (a WGMMA would
  round f32 to TF32, where the CUDA-core path keeps f32 caches exact), ``W, D <= 256`` (a
  WGMMA's N), no multi-query limit (its per-row extras stay on the CUDA-core path), and with
  RESA's prior ``2 rows <= 64`` (its rows share the 64-row tile with the query rows)."""
  dts = {jnp.dtype(x) for x in (q_dtype, k_dtype, v_dtype)}
  return (len(dts) == 1 and dts <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
          and w <= 256 and d <= 256 and not with_limit
          and (not with_prior or 2 * rows <= mc.TILE_ROWS))


def decode_partials(q, k, v, block_idx, n_valid, length, pos=None, row_bits=None, prior=None,
                    row_limit=None, *, block_size: int, scale: float, num_splits: int | None,
                    num_stages: int, softcap: float | None, interpret, bits_per_word: int = 32,
                    rows_per_prior: int = 1, epilogue=None, extras=(), mma: bool | None = None,
                    tokens_per_step: int | None = None, count_attended: bool = False,
                    carry_in=None, query_pos=None):
  """Runs the Mosaic GPU kernel: per-split partials, merged in XLA (``lse_combine``; with a
  prior ``split_combine_pairs``' jnp path, which also runs the epilogue).

  Args:
    q: ``[B, K, R, D]`` query rows of each kv head (R <= 64).
    k, v: ``[B, K, T, D]``; block_idx ``[B, K, n]``; n_valid ``[B, K]``; length ``[B]``.
      ``block_idx = n_valid = None``: the identity mode (dense decoding: entry ``i`` is block
      ``i``, ``ceil(length / bs)`` entries a row, no list read; without a row limit, bits or
      a prior); a cache of fewer than ``W`` slots runs it as explicit lists instead.
    pos: optional ``[B, K, T]`` int32 (-1 = empty slot).
    row_bits: optional ``[B, K, n]`` or ``[B, K, n, A]`` int32: row ``r`` uses an entry iff
      bit ``r % C`` of its word ``min(r // C, A - 1)`` is set (``C = bits_per_word``, static).
    prior: optional ``[B, K, R / rows_per_prior, T]`` float32 RESA prior logits of every slot
      (-inf: not a member; row ``r`` reads prior row ``r // rows_per_prior``). The listed
      slots' logits are gathered in XLA per step (``[B, K, n / J, R', W]``, proportional to the
      list, not to T): one TMA per step then, where a block's ``[R', 16]`` row piece would be
      64 bytes, under the 128 a warpgroup's TMA must move.
    row_limit: optional ``[B, K, R]`` int32, the last token position each row may attend (the
      multi-query window); with ``pos`` the listed slots' positions are gathered per step too.
    block_size, scale, num_splits, num_stages, softcap: static; interpret: see
      ``mc.interpret_params``; epilogue, extras: with ``prior``, as ``decode_partials`` of
      ``pallas_kernels._decode_kernel``.
    mma: the step's products on the tensor cores (``mma_usable``); None: wherever usable.
    tokens_per_step: W, a multiple of 64 and of ``block_size`` (default ``max(64, bs)``): a
      launch parameter for sweeps (``experiments.decode_sweep --mosaic``).
    count_attended: also count the keys each row attended (static; the CUDA-core path, so
      not with ``mma=True``, nor with an epilogue).
    carry_in: optional ``[(out [B, K, R, D], lse [B, K, R])]``, one per output pair: merged
      as one more split in the same merge (as ``split_combine_pairs``' ``carry_in``).
    query_pos: optional ``[B]`` int32, as the Triton ``decode_partials``': a padding row
      (negative) attends nothing and comes out empty.

  Returns:
    ``(out [B, K, R, D] f32, lse [B, K, R] f32)``; with ``prior`` also ``(prior_out,
    prior_lse)`` and ``seen [B, K, R]`` int32; with ``count_attended`` then ``attended [B, K,
    R]`` int32; with an ``epilogue``, its ``(out, lse)``.
  """
  b, kh, r, d = q.shape
  t = k.shape[2]
  identity = block_idx is None
  if identity and (row_bits is not None or prior is not None or row_limit is not None):
    raise ValueError("the identity mode (block_idx=None) takes no row bits, prior or limit")
  n = t // block_size if identity else block_idx.shape[-1]
  if r > mc.TILE_ROWS:
    raise ValueError(f"at most {mc.TILE_ROWS} query rows per kv head, got {r}")
  mc.check_minor_dim(d, q.dtype, k.dtype)
  w = tokens_per_step or max(mc.TILE_ROWS, block_size)
  if w % mc.TILE_ROWS or w % block_size:
    raise ValueError(f"tokens_per_step must be a multiple of {mc.TILE_ROWS} and of the block "
                     f"size {block_size}, got {w}")
  jn = w // block_size
  if identity and t < w:  # no W-token window fits: every block as an explicit list
    block_idx, n_valid = identity_lists(b, kh, n, length, block_size)
    identity = False
  copies = 1 if identity else jn
  if 2 * copies > MAX_BARRIERS:
    raise ValueError(f"tokens_per_step={w} is {jn} blocks of {block_size}: a ring of two such "
                     f"steps needs {2 * jn} barriers per tensor, more than {MAX_BARRIERS}")
  itemsize = jnp.dtype(k.dtype).itemsize
  with_limit, with_prior = row_limit is not None, prior is not None
  # Positions per step in a ring: the listed slots' (multi-query), or with identity the cache's
  # own window of pos (a W-slot row is >= 256 bytes, so TMA-able, where a block's 16 are not).
  with_positions = (with_limit or identity) and pos is not None
  prior_rows = prior.shape[2] if with_prior else 0
  if prior_rows * rows_per_prior not in (0, r):
    raise ValueError(f"prior rows {prior_rows} x {rows_per_prior} != {r} rows")
  if row_bits is not None and row_bits.ndim == 3:
    row_bits = row_bits[..., None]
  if count_attended and epilogue is not None:
    raise ValueError("an epilogue takes the prior's count only: no attended count with it")
  usable = mma_usable(q.dtype, k.dtype, v.dtype, w=w, d=d, with_limit=with_limit,
                      with_prior=with_prior, rows=r) and not count_attended
  if mma and not usable:
    raise ValueError(f"mma needs 16-bit q/k/v of one dtype, no row limit, W <= 256, D <= 256 "
                     f"and with a prior at most {mc.TILE_ROWS // 2} rows; got {q.dtype}/"
                     f"{k.dtype}/{v.dtype}, W={w}, D={d}, {r} rows")
  mma = usable if mma is None else mma
  # K, V (, prior, positions)
  per_stage = 2 * w * d * itemsize + prior_rows * w * 4 + (w * 4 if with_positions else 0)
  if 2 * per_stage > mc.RING_BYTES:
    raise ValueError(f"tokens_per_step={w}: a ring of two steps needs {2 * per_stage} bytes of "
                     f"shared memory, more than the {mc.RING_BYTES} a decode ring may fill")
  stages = max(2, min(num_stages, mc.RING_BYTES // per_stage, MAX_BARRIERS // copies))
  splits = num_splits or _common.choose_num_splits(b * kh, n)
  splits = max(1, min(splits, -(-n // jn)))
  params = mc.interpret_params(interpret)
  num_steps = -(-n // jn)

  def per_step(x, fill):  # [B, K, ..., n * bs] -> [B, K, ..., n / J, W]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, num_steps * w - n * block_size)],
                constant_values=fill)
    return x.reshape(*x.shape[:-1], num_steps, w)

  kernel = functools.partial(
      decode_body, rows=r, block_size=block_size, blocks_per_step=jn, stages=stages,
      num_blocks=t // block_size, list_len=n, max_splits=splits, scale=float(scale),
      softcap=softcap, with_pos=pos is not None and not with_positions,
      bits=None if row_bits is None else (row_bits.shape[-1], bits_per_word),
      with_limit=with_limit, with_positions=with_positions, with_prior=with_prior,
      rows_per_prior=rows_per_prior, mma=mma, identity=identity,
      regs=mc.Regs(params is not None), count_attended=count_attended,
      with_query_pos=query_pos is not None)
  # [B, K, 64, D]: the group's rows padded to one WGMMA-layout tile.
  q_pad = jnp.pad(q, ((0, 0), (0, 0), (0, mc.TILE_ROWS - r), (0, 0)))
  lse_pad = -(-r // 4) * 4  # a TMA store moves whole 16-byte rows
  scratch = [plgpu.SMEM((mc.TILE_ROWS, d), q.dtype, transforms=mc.smem_transforms(q.dtype)),
             plgpu.SMEM((stages, w, d), k.dtype, transforms=mc.smem_transforms(k.dtype)),
             plgpu.SMEM((stages, w, d), v.dtype, transforms=mc.smem_transforms(v.dtype))]
  scratch += [plgpu.SMEM((r, d), jnp.float32), plgpu.SMEM((lse_pad,), jnp.float32),
              plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=stages * copies),
              plgpu.Barrier(num_barriers=stages * copies)]
  args = [q_pad, k, v] + ([] if identity else [block_idx.astype(jnp.int32),
                                               n_valid.astype(jnp.int32)])
  args.append(length.astype(jnp.int32))
  if query_pos is not None:
    args.append(query_pos.astype(jnp.int32))
  if pos is not None and not with_positions:  # [B, K, n, words]: the listed blocks' only
    args.append(mc.slot_words(_common.gather_blocks(pos, block_idx, block_size), block_size))
  if row_bits is not None:
    args.append(row_bits.astype(jnp.int32))
  if with_limit:
    args.append(row_limit.astype(jnp.int32))
  if with_positions and identity:  # [B, K, T]
    args.append(pos.astype(jnp.int32))
  elif with_positions:  # [B, K, n / J, W], -1 (empty) past the list
    args.append(per_step(_common.gather_blocks(pos, block_idx, block_size).astype(jnp.int32),
                         -1))
  pair = (jax.ShapeDtypeStruct((b, kh, splits, r, d), jnp.float32),
          jax.ShapeDtypeStruct((b, kh, splits, lse_pad), jnp.float32))
  out_type = pair
  if with_prior:
    # [B, K, R', n * bs] -> [B, K, n / J, R', W]: each step's [R', W] prior tile contiguous
    pg = gather_prior(prior.reshape(b, kh * prior_rows, t), block_idx, block_size)
    args.append(jnp.swapaxes(per_step(pg, NEG_INF), 2, 3))
    out_type += pair + (jax.ShapeDtypeStruct((b, kh, splits, lse_pad), jnp.int32),)
    scratch += [plgpu.SMEM((stages, prior_rows, w), jnp.float32),
                plgpu.SMEM((r, d), jnp.float32), plgpu.SMEM((lse_pad,), jnp.float32),
                plgpu.SMEM((lse_pad,), jnp.int32), plgpu.Barrier(num_barriers=stages)]
  if with_positions:
    scratch += [plgpu.SMEM((stages, w), jnp.int32), plgpu.Barrier(num_barriers=stages)]
  if count_attended:
    out_type += (jax.ShapeDtypeStruct((b, kh, splits, lse_pad), jnp.int32),)
    scratch.append(plgpu.SMEM((lse_pad,), jnp.int32))
  name = "sparse_decode" + ("_multiquery" if with_limit else "") + ("_resa" if with_prior
                                                                     else "")
  outs = plgpu.kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=(b, kh, splits),
      grid_names=("b", "h", "s"), interpret=params, kernel_name=name + "_mosaic",
  )(*args)
  outs = [x if x.ndim == 5 else x[..., :r] for x in outs]  # lse, counts: drop the padding
  attended = (jnp.sum(outs.pop(), axis=2),) if count_attended else ()
  if not with_prior:
    out, lse = outs
    if carry_in is not None:  # one more split; a padding row's is dropped
      out_c, lse_c = _common.empty_padding_rows(*carry_in[0], query_pos)
      out = jnp.concatenate([out, out_c[:, :, None].astype(out.dtype)], axis=2)
      lse = jnp.concatenate([lse, lse_c[:, :, None].astype(lse.dtype)], axis=2)
    if out.shape[2] == 1:
      return out[:, :, 0], lse[:, :, 0], *attended
    return (*lse_combine(out, lse, axis=2), *attended)
  got = split_combine_pairs([tuple(outs[:2]), tuple(outs[2:4])], outs[4], epilogue=epilogue,
                            extras=extras, carry_in=carry_in, query_pos=query_pos, impl="xla")
  if epilogue is not None:
    return got
  (pair_true, pair_prior), seen = got
  return (*pair_true, *pair_prior, seen, *attended)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap", "mma",
                                             "tokens_per_step"))
def sparse_decode(q, k, v, block_idx, n_valid, length, *, block_size: int,
                  scale: float | None = None, num_splits: int | None = None,
                  impl: _common.Impl = "auto", interpret=False, num_warps: int = 4,
                  num_stages: int = 3, blocks_per_iter: int | None = None, pos=None,
                  softcap: float | None = None, mma: bool | None = None,
                  tokens_per_step: int | None = None, query_pos=None):
  """Exact attention of one query per head over the listed KV blocks (Mosaic GPU kernel).

  Args: as ``pallas_kernels.sparse_decode``:
    q: ``[B, N, D]`` queries; k, v: ``[B, K, T, D]`` cache, ``T`` a multiple of ``block_size``.
    block_idx: ``[B, H, n]`` int32 block ids, ``H = K`` (group-shared) or ``H = N``
      (per query head); entries at ``i >= n_valid`` are ignored.
    n_valid: ``[B, H]`` int32; length: ``[B]`` int32 (slots ``>= length`` never attended).
    pos: optional ``[B, K, T]`` int32 token position of each slot (-1 = empty, never attended).
    block_size: static, a power of 2 >= 16; scale: default ``1/sqrt(D)``.
    num_splits: most split-K slices (static), default from the problem size.
    impl: ``"xla"`` runs ``sparse_decode_reference``; any other value runs the Mosaic kernel.
    interpret: False (lower for the GPU), True (Mosaic GPU interpret mode on the CPU, race
      detection on) or an ``InterpretGPUParams``.
    num_warps, blocks_per_iter: accepted for the Triton twin's signature; one warpgroup per
      program here, and ``tokens_per_step`` sets the tokens a step reads.
    num_stages: depth of the TMA ring (>= 2; fewer when the ring would not fit in SMEM).
    softcap: static attention-logit soft-cap, None = none.
    query_pos: optional ``[B]`` int32 query position of each row (negative: a padding row,
      which attends nothing).
    mma: (Mosaic only) a step's two products as WGMMAs on the tensor cores (True), per row on
      CUDA cores (False), or wherever usable (None: 16-bit caches, ``mma_usable``).
    tokens_per_step: (Mosaic only) tokens a pipeline step reads (``decode_partials``).

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32 (``0`` / ``-inf`` for a row that
    attends nothing).
  """
  del num_warps, blocks_per_iter
  if impl == "xla":
    return sparse_decode_reference(q, k, v, block_idx, n_valid, length, block_size=block_size,
                                   scale=scale, pos=pos, softcap=softcap, query_pos=query_pos)
  softcap, lists = checked_lists(q, k, block_idx, n_valid, block_size, softcap)
  b, hq, d = q.shape
  hkv = k.shape[1]
  if lists is None:
    return jnp.zeros_like(q), jnp.full((b, hq), -jnp.inf, jnp.float32)
  idx, nv, bits = lists
  out, lse = decode_partials(
      q.reshape(b, hkv, hq // hkv, d), k, v, idx, nv, length, pos=pos,
      row_bits=None if bits is None else bits[..., 0],
      block_size=block_size, scale=default_scale(d, scale), num_splits=num_splits,
      num_stages=num_stages, softcap=softcap, interpret=interpret, mma=mma,
      tokens_per_step=tokens_per_step, query_pos=query_pos)
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "num_splits", "impl",
                                             "interpret", "num_warps", "num_stages",
                                             "blocks_per_iter", "softcap", "mma",
                                             "tokens_per_step"))
def dense_decode(q, k, v, length, *, block_size: int, scale: float | None = None,
                 num_splits: int | None = None, impl: _common.Impl = "auto", interpret=False,
                 num_warps: int = 4, num_stages: int = 3, blocks_per_iter: int | None = None,
                 pos=None, softcap: float | None = None, mma: bool | None = None,
                 tokens_per_step: int | None = None, query_pos=None):
  """``sparse_decode`` over every block of the context, in the kernel's identity mode: a step is
  one ``W``-token TMA per tensor, and no list is built or read (the Mosaic GPU twin of
  ``pallas_kernels.dense_decode``; the same arguments, plus ``mma`` and ``tokens_per_step`` as
  ``sparse_decode``'s).

  Returns:
    ``out [B, N, D]`` in ``q.dtype`` and ``lse [B, N]`` float32.
  """
  del num_warps, blocks_per_iter
  if impl == "xla":
    idx, nv = identity_lists(q.shape[0], k.shape[1], k.shape[2] // block_size, length,
                             block_size)
    return sparse_decode_reference(q, k, v, idx, nv, length, block_size=block_size,
                                   scale=scale, pos=pos, softcap=softcap, query_pos=query_pos)
  softcap = check_softcap(softcap)
  _common.check_block_size(block_size, k.shape[2])
  b, hq, d = q.shape
  hkv = k.shape[1]
  selection_rows(hq, hkv, hkv)
  out, lse = decode_partials(
      q.reshape(b, hkv, hq // hkv, d), k, v, None, None, length, pos=pos,
      block_size=block_size, scale=default_scale(d, scale), num_splits=num_splits,
      num_stages=num_stages, softcap=softcap, interpret=interpret, mma=mma,
      tokens_per_step=tokens_per_step, query_pos=query_pos)
  return out.reshape(b, hq, d).astype(q.dtype), lse.reshape(b, hq)
