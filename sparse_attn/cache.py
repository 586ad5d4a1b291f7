"""The KV cache pytree with per-block digests kept in sync on every write.

Letters: B batch, K kv heads, T capacity (slots), NB = T // block_size blocks, D head dim.

Slots are written at explicit indices, so append and overwrite (dense rectification, retro
re-embedding) are one operation, ``write``. Each slot also records the token position it holds
(``pos``, -1 when empty): an uncompressed cache has ``pos == slot``; a compressed cache
(compaction after eviction) keeps the original positions of the kept keys per head.

Block digests, recomputed from the block's valid keys after every write that touches it:
  * ``kmin, kmax [B, K, NB, D]``: the per-channel bounding box (Quest, Tang et al. 2024, Sec. 3.2);
  * ``kcen [B, K, NB, D]``, ``krad [B, K, NB]``: the centroid and the bounding-sphere radius
    ``max_j ||k_j - c||`` (the ``"sphere"`` kind; ArkVale's sphere-max bound, Chen et al. 2024,
    Sec. 5.2, Eq. 1-2, centred on the centroid);
  * ``kdev [B, K, NB, D]``: the per-channel mean absolute deviation of the keys from the box
    centre ``(kmin + kmax) / 2`` (the ``"mean_box"`` kind; ArkVale's cuboid-mean radius vector,
    Eq. 4: the box ``centre +- kdev`` is its default page digest);
  * ``kcos [B, K, NB]``: the least cosine similarity of a valid key to the block's mean key
    (the ``"cosine"`` kind; ShadowKV's outlier-chunk statistic, Sun et al. 2024, Sec. 4.2).
Empty blocks have all-zero digests; selectors mask them by ``length``. A cache keeps only the
digest kinds its method asks for (``init_cache(digests=...)``; methods keep the box, part of
every cache's contract, and ArkVale's kind only for ArkVale); an absent kind is a zero-length
``NB`` axis, so writes neither compute nor scatter it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Reads a block list of a cache array: ``x [B, K, T, ...]``, ``block_idx [B, H, n]`` ->
# ``[B, H, n * block_size, ...]`` (head h reads kv head h // (H // K)); shared with the kernels'
# references so both paths gather identically.
from pallas_kernels import gather_blocks  # pylint: disable=unused-import (re-exported)
from pallas_kernels import Impl, cache_append, resolve_impl
from pallas_kernels.cache_append import MAX_TOKENS as APPEND_TOKENS, new_length
from sparse_attn import ordering


class SlotBuffer:
  """Shape properties shared by the cache pytrees: ``k [B, ..., T, D]``, ``pos [B, ..., T]``
  (-1 = empty) and ``length [B]`` (slots in use)."""

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @property
  def capacity(self) -> int:
    """Slots per buffer (per kv head, or of the whole flat buffer)."""
    return self.k.shape[-2]

  @property
  def head_dim(self) -> int:
    return self.k.shape[-1]

  @property
  def valid(self) -> jax.Array:
    """``pos``-shaped bool: the slot holds a key that may be attended (``pos >= 0`` and
    ``slot < length``)."""
    slots = jnp.arange(self.capacity, dtype=jnp.int32)
    length = self.length.reshape((-1,) + (1,) * (self.pos.ndim - 1))
    return (self.pos >= 0) & (slots < length)

  def nbytes(self) -> int:
    """Bytes held by every buffer of the cache (what eviction must shrink)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(SlotBuffer):
  """Fixed-capacity KV cache of one layer.

  Attributes:
    k, v: ``[B, K, T, D]`` keys (post-RoPE) and values.
    pos: ``[B, K, T]`` int32 token position held by each slot, -1 if empty.
    length: ``[B]`` int32 number of slots in use (one past the highest written slot).
    kmin, kmax, kcen: ``[B, K, NB, D]`` block digests (cache dtype).
    krad: ``[B, K, NB]`` float32 bounding-sphere radius per block.
    kdev: ``[B, K, NB, D]`` mean absolute deviation from the box centre (cache dtype).
    kcos: ``[B, K, NB]`` float32 least cosine similarity of a key to the block mean (None, as
      from a constructor that predates it, reads as not kept).
    (A digest kind the method does not read has a zero-length ``NB`` axis: ``has_digests``.)
    block_size: static block (page) size.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  length: jax.Array
  kmin: jax.Array
  kmax: jax.Array
  kcen: jax.Array
  krad: jax.Array
  kdev: jax.Array
  kcos: jax.Array | None = None
  block_size: int = dataclasses.field(metadata=dict(static=True), default=16)

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[1]

  @property
  def num_blocks(self) -> int:
    return self.capacity // self.block_size

  def has_digests(self, kind: str) -> bool:
    """Whether the cache keeps the ``"box"`` (kmin, kmax), ``"sphere"`` (kcen, krad),
    ``"mean_box"`` (kdev) or ``"cosine"`` (kcos) digests."""
    arr = {"box": self.kmin, "sphere": self.kcen, "mean_box": self.kdev, "cosine": self.kcos}[kind]
    return (arr is not None and arr.shape[2] > 0) or self.num_blocks == 0

  @property
  def digest_kinds(self) -> tuple[str, ...]:
    """The digest kinds this cache keeps (static: read from the array shapes)."""
    return tuple(k for k in DIGEST_KINDS if self.has_digests(k))


DIGEST_KINDS = ("box", "sphere", "mean_box", "cosine")
# The cache's digest arrays (fields), every kind's.
DIGEST_FIELDS = ("kmin", "kmax", "kcen", "krad", "kdev", "kcos")


def _check_digests(digests):
  bad = sorted(set(digests) - set(DIGEST_KINDS))
  if bad:
    raise ValueError(f"unknown digest kind(s) {bad}; valid: {DIGEST_KINDS}")


def init_cache(batch: int, num_kv_heads: int, capacity: int, head_dim: int,
               block_size: int = 16, dtype=jnp.float32, digests=DIGEST_KINDS) -> KVCache:
  """An empty cache of ``capacity`` slots (a multiple of ``block_size``) keeping the block
  ``digests`` kinds (``DIGEST_KINDS``; absent ones have zero blocks)."""
  _check_digests(digests)
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  if capacity <= 0 or capacity % block_size:
    raise ValueError(
        f"capacity {capacity} must be a positive multiple of block_size {block_size}")
  nb = capacity // block_size
  shape = (batch, num_kv_heads, capacity, head_dim)
  box = (batch, num_kv_heads, nb if "box" in digests else 0, head_dim)
  sphere = (batch, num_kv_heads, nb if "sphere" in digests else 0, head_dim)
  mean_box = (batch, num_kv_heads, nb if "mean_box" in digests else 0, head_dim)
  return KVCache(
      k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
      pos=jnp.full(shape[:3], -1, jnp.int32), length=jnp.zeros((batch,), jnp.int32),
      kmin=jnp.zeros(box, dtype), kmax=jnp.zeros(box, dtype),
      kcen=jnp.zeros(sphere, dtype), krad=jnp.zeros(sphere[:3], jnp.float32),
      kdev=jnp.zeros(mean_box, dtype),
      kcos=jnp.zeros(sphere[:2] + (nb if "cosine" in digests else 0,), jnp.float32),
      block_size=block_size)


def keep_digests(cache: KVCache, digests) -> KVCache:
  """``cache`` without the digest kinds not in ``digests`` (zero blocks; e.g. a method's copy
  of a shared prefill that kept the union of its members' kinds)."""
  _check_digests(digests)
  empty = lambda x: x[:, :, :0]
  box, sphere = "box" in digests, "sphere" in digests
  return dataclasses.replace(
      cache, kmin=cache.kmin if box else empty(cache.kmin),
      kmax=cache.kmax if box else empty(cache.kmax),
      kcen=cache.kcen if sphere else empty(cache.kcen),
      krad=cache.krad if sphere else empty(cache.krad),
      kdev=cache.kdev if "mean_box" in digests else empty(cache.kdev),
      kcos=cache.kcos if "cosine" in digests or cache.kcos is None else empty(cache.kcos))


def with_digests(cache: KVCache, digests) -> KVCache:
  """``cache`` keeping exactly the ``digests`` kinds: the ones it lacks computed from its keys
  (``block_digests``, ``block_cosines``), the ones not asked for dropped. A dense prefill's
  cache (the compression methods' shared one) becomes a selector's as its own prefill left it."""
  _check_digests(digests)
  missing = [kind for kind in digests if not cache.has_digests(kind)]
  if missing:
    kmin, kmax, kcen, krad, kdev = block_digests(cache.k, cache.valid, cache.block_size)
    new = dict(box=dict(kmin=kmin, kmax=kmax), sphere=dict(kcen=kcen, krad=krad),
               mean_box=dict(kdev=kdev))
    if "cosine" in missing:
      new["cosine"] = dict(kcos=block_cosines(cache.k, cache.valid, cache.block_size))
    cache = dataclasses.replace(cache, **{f: x for kind in missing for f, x in new[kind].items()})
  return keep_digests(cache, digests)


def block_digests(k, valid, block_size):
  """Digests of whole blocks from their valid keys.

  Args:
    k: ``[..., NB * block_size, D]`` keys.
    valid: ``[..., NB * block_size]`` bool.
    block_size: static.

  Returns:
    ``kmin, kmax, kcen [..., NB, D]`` (dtype of k), ``krad [..., NB]`` float32 and
    ``kdev [..., NB, D]`` (dtype of k); zeros for blocks with no valid key.
  """
  *lead, t, d = k.shape
  nb = t // block_size
  kb = k.reshape(*lead, nb, block_size, d).astype(jnp.float32)
  vb = valid.reshape(*lead, nb, block_size, 1)
  cnt = jnp.sum(vb, axis=-2)  # [..., NB, 1]
  any_valid = cnt > 0
  kmin = jnp.where(any_valid, jnp.min(jnp.where(vb, kb, jnp.inf), axis=-2), 0.0)
  kmax = jnp.where(any_valid, jnp.max(jnp.where(vb, kb, -jnp.inf), axis=-2), 0.0)
  kcen = jnp.sum(jnp.where(vb, kb, 0.0), axis=-2) / jnp.maximum(cnt, 1)
  dist = jnp.sqrt(jnp.sum(jnp.square(kb - kcen[..., None, :]), axis=-1))
  krad = jnp.max(jnp.where(vb[..., 0], dist, 0.0), axis=-1)
  centre = 0.5 * (kmin + kmax)
  kdev = jnp.sum(jnp.where(vb, jnp.abs(kb - centre[..., None, :]), 0.0), axis=-2) / jnp.maximum(
      cnt, 1)
  dt = k.dtype
  return kmin.astype(dt), kmax.astype(dt), kcen.astype(dt), krad, kdev.astype(dt)


def block_cosines(k, valid, block_size):
  """``kcos [..., NB]`` float32: per block, the least cosine similarity of a valid key of
  ``k [..., NB * block_size, D]`` to the block's mean key (``valid`` as ``block_digests``; 1
  for blocks with no valid key; zero vectors have similarity 0, as torch's cosine_similarity
  with its 1e-8 floor on the norms gives)."""
  *lead, t, d = k.shape
  kb = k.reshape(*lead, t // block_size, block_size, d).astype(jnp.float32)
  vb = valid.reshape(*lead, t // block_size, block_size)
  mean = jnp.sum(jnp.where(vb[..., None], kb, 0.0), axis=-2) / jnp.maximum(
      jnp.sum(vb, axis=-1, keepdims=True), 1)
  dot = jnp.sum(kb * mean[..., None, :], axis=-1)
  norms = jnp.maximum(jnp.linalg.norm(kb, axis=-1) * jnp.linalg.norm(mean, axis=-1)[..., None],
                      1e-8)
  return jnp.min(jnp.where(vb, dot / norms, 1.0), axis=-1)


def _check_write(cache: KVCache, k_new, v_new, positions):
  b, hkv, _, d = cache.k.shape
  s = positions.shape[-1]
  want = (b, hkv, s, d)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if tuple(x.shape) != want:
      raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want} "
                       f"(cache [B={b}, Hkv={hkv}, T={cache.capacity}, D={d}], {s} positions)")
    if x.dtype != cache.k.dtype:
      raise ValueError(f"{name} has dtype {x.dtype}, the cache holds {cache.k.dtype}")
  if positions.shape != (b, s):
    raise ValueError(f"positions has shape {positions.shape}, expected ({b}, {s})")
  if s > cache.capacity:
    raise ValueError(f"writing {s} positions into a cache of capacity {cache.capacity}")
  try:  # concrete positions can be checked eagerly; traced ones are dropped if out of range
    hi = int(jnp.max(positions))
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return
  if hi >= cache.capacity:
    raise ValueError(f"write at slot {hi} past the cache capacity {cache.capacity}")


def scatter_set(arr, index, values):
  """``arr.at[index].set(values, mode="drop")``, in place for 16-bit floats too.

  XLA:CPU has no bf16/f16 scatter: it converts the whole buffer to f32 and back around it (a
  full copy, ~100 ms per decode step at 32k for Llama-8B's cache). A scatter of the same bits
  viewed as uint16 is native and stays in place.
  """
  values = values.astype(arr.dtype)
  if jnp.dtype(arr.dtype).itemsize != 2 or not jnp.issubdtype(arr.dtype, jnp.floating):
    return arr.at[index].set(values, mode="drop")
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
  out = bits(arr).at[index].set(bits(values), mode="drop")
  return jax.lax.bitcast_convert_type(out, arr.dtype)


def write(cache: KVCache, k_new, v_new, positions, token_positions=None, *,
          impl: Impl = "xla", interpret: bool = False, after=()) -> KVCache:
  """Writes keys/values at explicit slots (append and overwrite alike).

  Args:
    cache: the layer cache.
    k_new, v_new: ``[B, K, S, D]`` in the cache dtype.
    positions: ``[B, S]`` int32 slot of each new entry; negative = skip (padding).
    token_positions: ``[B, S]`` or ``[B, K, S]`` token positions recorded in ``pos``
      (default: ``positions``; differs after compaction).
    impl, interpret: ``"pallas"`` writes up to ``cache_append.MAX_TOKENS`` tokens a row into a
      cache keeping only the box digests in one kernel (``pallas_kernels.cache_append``), the
      same result.
    after: arrays (a pytree) whose producers must run before the write, e.g. a read of the
      slots it overwrites: operands of the kernel (no op), else ``ordering.after`` on the rows.

  Returns:
    The cache with the entries written, ``length`` advanced and the digests of every touched
    block recomputed from the block's valid keys.
  """
  _check_write(cache, k_new, v_new, positions)
  b, hkv, t, d = cache.k.shape
  bs = cache.block_size
  s = positions.shape[-1]
  positions = positions.astype(jnp.int32)
  if token_positions is None:
    token_positions = positions
  token_positions = token_positions.astype(jnp.int32)
  if (s <= APPEND_TOKENS and cache.digest_kinds == ("box",)
      and resolve_impl(impl, "cache_append") != "xla"):
    # The kernel takes the slots and positions as given (out of range: no write) and
    # advances the length itself: no XLA op around the launch.
    k, v, pos, kmin, kmax, length = cache_append(
        cache.k, cache.v, cache.pos, cache.kmin, cache.kmax, k_new, v_new, positions,
        token_positions, cache.length, block_size=bs, impl=impl, interpret=interpret,
        after=after)
    return dataclasses.replace(cache, k=k, v=v, pos=pos, length=length, kmin=kmin, kmax=kmax)
  if jax.tree.leaves(after):
    k_new, v_new = (ordering.after(x, *jax.tree.leaves(after)) for x in (k_new, v_new))
  # Out-of-range slot = dropped by the scatter.
  slot = jnp.where((positions >= 0) & (positions < t), positions, t)
  tok = jnp.broadcast_to(
      token_positions if token_positions.ndim == 3 else token_positions[:, None, :],
      (b, hkv, s))
  bi = jnp.arange(b)[:, None, None]
  hi = jnp.arange(hkv)[None, :, None]
  length = new_length(positions, cache.length, t)
  si = slot[:, None, :]
  k = scatter_set(cache.k, (bi, hi, si), k_new)
  v = scatter_set(cache.v, (bi, hi, si), v_new)
  pos = cache.pos.at[bi, hi, si].set(tok, mode="drop")
  new = dataclasses.replace(cache, k=k, v=v, pos=pos, length=length)
  if s >= cache.num_blocks:
    return _refresh_all_digests(new)
  return _refresh_block_digests(new, slot // bs)


def _refresh_all_digests(cache: KVCache) -> KVCache:
  """Every block's digests, of the kinds ``cache`` keeps (XLA drops the others' computation)."""
  kmin, kmax, kcen, krad, kdev = block_digests(cache.k, cache.valid, cache.block_size)
  kcos = block_cosines(cache.k, cache.valid, cache.block_size)
  full = dataclasses.replace(cache, kmin=kmin, kmax=kmax, kcen=kcen, krad=krad, kdev=kdev,
                             kcos=kcos)
  return keep_digests(full, cache.digest_kinds)


def _refresh_block_digests(cache: KVCache, blocks) -> KVCache:
  """Recomputes the digests of ``blocks [B, S]`` (ids >= NB are ignored)."""
  b, hkv, t, d = cache.k.shape
  bs, nb = cache.block_size, cache.num_blocks
  s = blocks.shape[-1]
  safe = jnp.minimum(blocks, nb - 1)
  # [B, K, M, bs] slots of each touched block
  slots = (safe[:, None, :, None] * bs + jnp.arange(bs)).astype(jnp.int32)
  slots = jnp.broadcast_to(slots, (b, hkv, s, bs)).reshape(b, hkv, s * bs)
  kb = jnp.take_along_axis(cache.k, slots[..., None], axis=2)
  vb = jnp.take_along_axis(cache.valid, slots, axis=2)
  kmin, kmax, kcen, krad, kdev = block_digests(kb, vb, bs)  # [B, K, M, D]
  bi = jnp.arange(b)[:, None, None]
  hi = jnp.arange(hkv)[None, :, None]
  idx = jnp.where(blocks < nb, blocks, nb)[:, None, :]
  upd = lambda arr, val: scatter_set(arr, (bi, hi, idx), val) if arr.shape[2] else arr
  kcos = cache.kcos
  if kcos is not None and kcos.shape[2]:
    kcos = upd(kcos, block_cosines(kb, vb, bs))
  return dataclasses.replace(cache, kmin=upd(cache.kmin, kmin), kmax=upd(cache.kmax, kmax),
                             kcen=upd(cache.kcen, kcen), krad=upd(cache.krad, krad),
                             kdev=upd(cache.kdev, kdev), kcos=kcos)


def replace_storage(cache: KVCache, k, v, pos, length) -> KVCache:
  """A cache over new storage (e.g. after compaction); the kept digest kinds recomputed."""
  new = dataclasses.replace(cache, k=k, v=v, pos=pos.astype(jnp.int32),
                            length=length.astype(jnp.int32))
  return _refresh_all_digests(new)  # the old digests' shapes only say which kinds are kept
