"""Helpers shared by the Mosaic GPU kernels: interpret-mode parameters, register layouts, SMEM
tiles, slot-validity words.

Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``) gives every register array a layout. The
kernels here keep 2-D tiles in the WGMMA layout (``[64 k, N]`` tiles; row reductions and
broadcasts are cheap there), per-row vectors in ``ROW`` (the layout a reduction over the minor
axis leaves) and per-column vectors in ``COL``. ``Regs`` applies those layout casts only when
the kernel is lowered for a GPU: Mosaic GPU's interpret mode (``InterpretGPUParams``) runs the
kernel's jaxpr on the CPU and has no rule for ``layout_cast``, which is a no-op on values anyway.

Shared-memory tiles are TMA destinations with the layout a WGMMA-layout load needs: (8, 128 B)
tiles and a 128-byte swizzle (``smem_transforms``), so the minor dimension (the head dim) must be
a multiple of 128 bytes / itemsize (64 bf16, 32 f32 elements).
"""

from __future__ import annotations

import dataclasses

from jax import lax
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

NEG_INF = float("-inf")
SWIZZLE = 128  # bytes
# Rows of a WGMMA-layout tile: K/V tiles hold a multiple of this many tokens.
TILE_ROWS = 64
# Shared memory a decode program may fill with its K/V ring (an H100 block may hold 227 KB).
RING_BYTES = 160 * 1024

__all__ = ["InterpretGPUParams", "Regs", "interpret_params", "smem_transforms",
           "check_minor_dim", "where", "bcast", "rows_of", "mma", "slot_words"]


def interpret_params(interpret) -> InterpretGPUParams | None:
  """The ``interpret=`` of ``plgpu.kernel``: None (lower for the GPU), or GPU interpret mode.

  Args:
    interpret: False / None (compile for the GPU), True (interpret with race detection on) or
      an ``InterpretGPUParams`` (hashable; passed as given).
  """
  if interpret is None or interpret is False:
    return None
  if interpret is True:
    return InterpretGPUParams(detect_races=True)
  if not isinstance(interpret, InterpretGPUParams):
    raise TypeError(f"interpret must be a bool or InterpretGPUParams, got {interpret!r}")
  return interpret


def smem_transforms(dtype):
  """TMA/WGMMA-friendly SMEM tiling of a 2-D tile of ``dtype``: (8, 128 B) tiles, 128 B
  swizzle."""
  minor = SWIZZLE * 8 // jnp.dtype(dtype).itemsize // 8
  return (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(SWIZZLE))


def check_minor_dim(d: int, *dtypes) -> None:
  """Raises unless ``d`` fills whole swizzled 128-byte rows for every dtype."""
  for dt in dtypes:
    minor = SWIZZLE // jnp.dtype(dt).itemsize
    if d % minor:
      raise ValueError(f"the Mosaic GPU kernels need a head dim that is a multiple of {minor} "
                       f"for {jnp.dtype(dt).name}, got {d}")


@dataclasses.dataclass(frozen=True)
class Regs:
  """Register-array helpers of one kernel trace (``interp``: traced for interpret mode)."""
  interp: bool

  tile = plgpu.Layout.WGMMA
  row = plgpu.Layout.WGMMA.reduce(1)  # [M] one value per tile row (token)
  col = plgpu.Layout.WGMMA.reduce(0)  # [N] one value per tile column (channel)

  def cast(self, x, layout):
    return x if self.interp else plgpu.layout_cast(x, layout)

  def iota(self, shape, dim, layout):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=None if self.interp else layout)

  def load_vec(self, ref, layout):
    """A 1-D SMEM vector into registers in ``layout`` (``row`` or ``col``)."""
    return ref[...] if self.interp else plgpu.load(ref, (), layout=layout)

  def load_tile(self, ref):
    """A ``[64 k, N]`` SMEM tile into registers (WGMMA layout), as float32."""
    return self.cast(ref[...], self.tile).astype(jnp.float32)


def where(cond, x, y):
  """``lax.select`` with scalar operands broadcast to ``cond`` (``jnp.where`` is a jitted call,
  which the GPU interpreter cannot run inside a kernel)."""
  dtype = jnp.result_type(x, y)
  x, y = (lax.broadcast_in_dim(jnp.asarray(a, dtype), cond.shape, ()) if jnp.ndim(a) == 0
          else a.astype(dtype) for a in (x, y))
  return lax.select(cond, x, y)


def bcast(x, shape, dims):
  return lax.broadcast_in_dim(x, shape, dims)


def rows_of(tile, rows: int, regs: Regs):
  """The first ``rows`` rows of a ``[64, N]`` register tile as ``[N]`` column-layout vectors
  (a masked sum over the rows: Mosaic has no register slicing across the WGMMA row split)."""
  m, n = tile.shape
  rid = regs.iota((m, n), 0, regs.tile)
  return [jnp.sum(where(rid == r, tile, 0.0), axis=0) for r in range(rows)]


def mma(a, b, shape, *, a_in_smem: bool, transpose_b: bool, regs: Regs):
  """``a @ b`` (``a @ b^T`` with ``transpose_b``) as a ``shape = [64, N]`` float32 WGMMA-layout
  tile, on the tensor cores (one WGMMA of the warpgroup).

  Args:
    a: ``[64, K]`` 16-bit operand: an SMEM ref (tiled, swizzled: ``smem_transforms``;
      ``a_in_smem``) or a WGMMA-layout register array.
    b: SMEM ref, ``[K, N]`` (``[N, K]`` with ``transpose_b``), tiled and swizzled.
    shape: static ``(64, N)``; transpose_b: static; regs: the trace's ``Regs``.

  Under Mosaic GPU's interpreter (``regs.interp``) the product is a float32-accumulated
  ``dot_general`` of the same operands: JAX 0.10.2's interpreter runs a WGMMA only with both
  operands in SMEM and no transposed view, so there the tensor-core instruction itself is
  checked by the CUDA lowering, not by interpretation.
  """
  if regs.interp:
    a_val = a[...] if a_in_smem else a
    dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
    return lax.dot_general(a_val, b[...], dims, preferred_element_type=jnp.float32)
  b_op = plgpu.transpose_ref(b, (1, 0)) if transpose_b else b

  def run(acc_ref):
    plgpu.wgmma(acc_ref, a, b_op)
    return acc_ref[...]  # waits for the WGMMA: the ring slot may be refilled after this
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def slot_words(pos, block_size: int):
  """``pos [B, K, T]`` -> ``[B, K, NB, ceil(bs / 32)]`` int32: bit ``i % 32`` of word
  ``i // 32`` of a block is set where its slot ``i`` holds a token (``pos >= 0``).

  The kernel reads one scalar word per listed block instead of copying 16-slot position rows (a
  TMA moves multiples of 128 bytes per warpgroup: 32 int32 slots)."""
  b, kh, t = pos.shape
  nw = -(-block_size // 32)
  held = (pos >= 0).reshape(b, kh, t // block_size, block_size)
  held = jnp.pad(held, ((0, 0), (0, 0), (0, 0), (0, nw * 32 - block_size)))
  bits = jnp.left_shift(jnp.int32(1), jnp.arange(32, dtype=jnp.int32))
  held = held.reshape(b, kh, t // block_size, nw, 32)
  # Bit 31 is the sign bit: the sum of distinct powers of two wraps exactly in int32.
  return jnp.sum(jnp.where(held, bits, 0), axis=-1, dtype=jnp.int32)
