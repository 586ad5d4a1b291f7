"""Rotary position embeddings (Su et al. 2021) with Llama's scaling variants.

Half-split convention (Hugging Face ``rotate_half``): channel ``i`` pairs with ``i + D/2``.
llama.cpp stores Llama Q/K rows interleaved instead; ``gguf_loader`` undoes that permutation
so one convention serves every checkpoint.

Scalings (``RopeConfig.rope_type``):
  * ``default``: ``inv_freq_i = theta^(-2i/D)``;
  * ``linear``: positions divided by ``factor`` (Chen et al. 2023, position interpolation);
  * ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
    (Llama 3.1 report, Sec. 3.2 / Meta's reference ``apply_scaling``);
  * ``longrope``: each frequency divided by its own factor, ``short_factor`` while a call's
    positions stay within ``original_max_position_embeddings`` and ``long_factor`` past it, and
    ``cos``/``sin`` multiplied by ``attention_factor`` (Ding et al. 2024, LongRoPE; Phi-3
    report's ``su`` scaling). ``forward`` switches per call, on the call's largest position,
    as transformers' ``longrope_frequency_update``; a decode run fixes one set for all its
    steps by its cache capacity (``RopeConfig.for_context``), so chunked prefill, decode
    steps and the cache agree;
  * ``freq_factors`` (any type): divisors applied last, as llama.cpp applies a GGUF's
    ``rope_freqs`` (``ggml_rope_ext``'s ``freq_factors``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig
from sparse_attn.compression import rope as rotation


def model_inv_freq(config, local: bool = False) -> tuple:
  """A model's ``[D/2]`` RoPE inverse frequencies (scaling applied; its global layers', or with
  ``local`` its local layers' (Gemma 3's ``local_rope``); LongRoPE's long set where the config
  fixed it, ``ModelConfig.for_context``) as a tuple of floats, the form a method's
  ``rope_inv_freq`` option takes."""
  return tuple(float(f) for f in inverse_frequencies(config.rope_of(local), config.head_dim,
                                                     bool(config.rope.longrope_long)))


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> np.ndarray:
  """``[D/2]`` float32 inverse frequencies after scaling (``long``: LongRoPE's long factors)."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
  inv = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
  if rope.rope_type == "longrope":
    ext = np.asarray(rope.long_factor if long else rope.short_factor, np.float32)
    inv = (1.0 / (ext * np.float32(rope.theta) ** exponents)).astype(np.float32)
  elif rope.rope_type == "linear":
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
  if rope.freq_factors is not None:
    inv = (inv / np.asarray(rope.freq_factors, np.float32)).astype(np.float32)
  return inv


def scaled_tables(rope: RopeConfig, head_dim: int, positions):
  """``cos, sin [B, 1, S, D/2]`` of ``positions [B, S]`` under ``rope``'s scaling: LongRoPE's
  short or long factors by the call's largest position, times its ``attention_factor``."""
  cos, sin = tables(positions, inverse_frequencies(rope, head_dim, bool(rope.longrope_long)))
  if rope.rope_type != "longrope":
    return cos, sin
  a = np.float32(rope.attention_factor)
  if rope.longrope_long is not None:
    return cos * a, sin * a
  long_cos, long_sin = tables(positions, inverse_frequencies(rope, head_dim, long=True))
  use_long = jnp.max(positions) + 1 > rope.original_max_position_embeddings
  return (jnp.where(use_long, long_cos, cos) * a, jnp.where(use_long, long_sin, sin) * a)



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
