"""Rotary position embeddings (Su et al. 2021) with Llama's scaling variants.

Half-split convention (Hugging Face ``rotate_half``): channel ``i`` pairs with ``i + D/2``.
llama.cpp stores Llama Q/K rows interleaved instead; ``gguf_loader`` undoes that permutation
so one convention serves every checkpoint.

Scalings (``RopeConfig.rope_type``):
  * ``default``: ``inv_freq_i = theta^(-2i/D)``;
  * ``linear``: positions divided by ``factor`` (Chen et al. 2023, position interpolation);
  * ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
    (Llama 3.1 report, Sec. 3.2 / Meta's reference ``apply_scaling``).
"""

from __future__ import annotations

import math

import numpy as np

from models.config import RopeConfig
from sparse_attn.compression import rope as rotation


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """``[D/2]`` float32 inverse frequencies after scaling."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
  if rope.rope_type == "linear":
    inv = inv / np.float32(rope.factor)
  elif rope.rope_type == "llama3":
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled).astype(np.float32)
  elif rope.rope_type != "default":
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")
  return inv


def apply_rope(x, positions, inv_freq):
  """Rotates ``x`` by its positions.

  Args:
    x: ``[B, H, S, D]`` queries or keys.
    positions: ``[B, S]`` int token positions (negative = padding; rotated anyway, finite).
    inv_freq: ``[D/2]`` float32 inverse frequencies.

  Returns:
    ``[B, H, S, D]`` in ``x.dtype`` (the rotation is computed in float32).
  """
  return rotation.rotate(x, positions, inv_freq)


def tables(positions, inv_freq):
  """``cos, sin [B, 1, S, D/2]`` of ``positions [B, S]``: computed once, shared by q and k."""
  return rotation.cos_sin(positions[:, None], inv_freq)


def rotate(x, cos, sin):
  """``x [B, H, S, D]`` rotated by ``tables``' ``cos, sin`` (``apply_rope`` in two steps)."""
  return rotation.rotate_with(x, cos, sin)
