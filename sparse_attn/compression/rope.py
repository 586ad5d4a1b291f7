"""RoPE for the compression methods that model it: frequencies, rotation and the config mixin.

Expected Attention (pre-RoPE query statistics, Devoto et al. 2025, Eq. 5), StreamingLLM's
rolling positions (Xiao et al. 2024, Sec. 3.2) and FINCH's key re-rotation (``rerotate_kept``)
need the model's RoPE; the half-split convention of ``models.rope`` is used throughout.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sparse_attn import cache as cache_lib
from sparse_attn.compression import flat


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
  """``[D/2]`` RoPE inverse frequencies ``theta^(-2i/D)`` (Su et al. 2021)."""
  return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(
      np.float32)


def cos_sin(offsets, inv_freq):
  """``cos, sin`` of ``offsets [...] * inv_freq [D/2]``: two float32 ``[..., D/2]`` tables."""
  angles = offsets.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  return jnp.cos(angles), jnp.sin(angles)


def rotate_with(x, cos, sin):
  """Half-split RoPE rotation of ``x [..., D]`` by tables ``cos, sin [..., D/2]``
  (broadcastable): channel ``i`` pairs with ``i + D/2``. Computed in float32, returned in
  ``x``'s dtype."""
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  x1, x2 = xf[..., :half], xf[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rotate_by(x, offsets, inv_freq):
  """RoPE rotation of ``x [B, H, S, D]`` by ``offsets`` (broadcastable to ``[B, H, S]``).

  Computed in float32, returned in ``x``'s dtype.
  """
  return rotate_with(x, *cos_sin(offsets, inv_freq))


def contiguous_offsets(pos, valid, next_pos):
  """``[..., T]`` rotation offsets that move each row's valid keys to consecutive positions.

  The ``j``-th valid slot (slot order) of a row holding ``n`` goes to ``next_pos - n + j``: the
  row's keys end just before the next token, so a later query at its own position ``next_pos +
  i`` sees the ``j``-th key at distance ``n + i - j``, as with keys at ``0 .. n-1`` and the query
  at ``n + i`` (RoPE logits depend only on the distance). Valid slots must be in position order.

  Args:
    pos: ``[..., T]`` token positions; valid: ``[..., T]`` bool.
    next_pos: the row's next token position, broadcastable to ``pos[..., :1]``.
  """
  index = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1
  n = jnp.sum(valid, axis=-1, keepdims=True, dtype=jnp.int32)
  return jnp.where(valid, next_pos - n + index - pos, 0)


def rerotate_kept(cache, next_pos, inv_freq):
  """``cache`` with every kv head's keys re-rotated to consecutive positions
  (``contiguous_offsets``; ``next_pos [B]``), positions and values unchanged.

  A per-head ``KVCache`` gets its digests recomputed; an Ada-KV ``FlatKVCache`` (one buffer per
  layer, each head's slots in token order) is re-rotated head by head.
  """
  if isinstance(cache, flat.FlatKVCache):
    view = flat.heads_view(cache)  # pos [B, K, Tf], -1 outside each row's head
    off = contiguous_offsets(view.pos, view.valid, next_pos[:, None, None])
    k = rotate_with(cache.k, *cos_sin(jnp.sum(off, axis=1), inv_freq))  # one head per slot
    return dataclasses.replace(cache, k=k)
  off = contiguous_offsets(cache.pos, cache.valid, next_pos[:, None, None])
  return cache_lib.replace_storage(cache, rotate_by(cache.k, off, inv_freq), cache.v, cache.pos,
                                   cache.length)


def rotate(x, positions, inv_freq):
  """RoPE rotation of ``x [B, N, S, D]`` by token ``positions [B, S]`` (every head alike)."""
  return rotate_by(x, positions[:, None], inv_freq)


@dataclasses.dataclass(frozen=True)
class RopeOptions:
  """The model's RoPE as a method option (mixed into a ``CompressionMethod``).

  Attributes:
    rope_theta: RoPE base of the model.
    rope_inv_freq: ``D/2`` inverse frequencies (a tuple; for scaled RoPE), instead of theta.
    rope_from_model: ``rope_inv_freq`` came from ``with_rope`` (the model's), not the caller,
      so a later ``with_rope`` replaces it: a LongRoPE model's frequencies depend on the run's
      length (``ModelConfig.for_context``), which the experiments learn after building the
      method (``specs.for_model`` gives the short set; the run's ``decode.with_model_rope``
      the run's). Frequencies the caller set are never replaced.
  """

  rope_theta: float | None = None
  rope_inv_freq: tuple | None = None
  rope_from_model: bool = dataclasses.field(default=False, repr=False)

  def _check_rope(self):
    if self.rope_theta is not None and self.rope_inv_freq is not None:
      raise ValueError("give rope_theta or rope_inv_freq, not both")
    if self.rope_theta is not None and self.rope_theta <= 0:
      raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
    if self.rope_inv_freq is not None:
      object.__setattr__(self, "rope_inv_freq", tuple(float(f) for f in self.rope_inv_freq))

  def inv_freq(self, head_dim: int) -> np.ndarray | None:
    """``[D/2]`` RoPE inverse frequencies, or None when no RoPE config was given."""
    if self.rope_inv_freq is not None:
      if 2 * len(self.rope_inv_freq) != head_dim:
        raise ValueError(f"rope_inv_freq has {len(self.rope_inv_freq)} entries, "
                         f"head_dim {head_dim} needs {head_dim // 2}")
      return np.asarray(self.rope_inv_freq, np.float32)
    if self.rope_theta is not None:
      return inverse_frequencies(head_dim, self.rope_theta)
    return None

  def with_rope(self, inv_freq):
    """This method with the model's RoPE frequencies ``[D/2]`` (replacing a model's given
    before), unless the caller set its own."""
    own = self.rope_theta is not None or (self.rope_inv_freq is not None
                                          and not self.rope_from_model)
    if own:
      return self
    freq = tuple(float(f) for f in inv_freq)
    if freq == self.rope_inv_freq:
      return self
    return dataclasses.replace(self, rope_inv_freq=freq, rope_from_model=True)
