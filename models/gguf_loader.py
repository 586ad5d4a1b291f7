"""GGUF (llama.cpp) checkpoints -> HF-named float32 tensors, config and tokenizer.

Tensors are dequantised with ``gguf.quants.dequantize`` (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K/...,
F16/F32), renamed to Hugging Face names and handed to ``hf_loader.convert_state_dict``, so a
GGUF takes the same path as a safetensors checkpoint.

Per architecture (``models.gguf_arch``: llama, qwen2, qwen3, gemma2, gemma3, phi3), the
metadata becomes the Hugging Face ``config.json`` it describes and tensor names become HF names;
llama.cpp's conventions are undone on read: Llama's Q/K row permutation (``unpermute_rows``),
Gemma's norms stored as ``1 + w``, Phi-3's fused ``attn_qkv`` / ``ffn_up`` (split like the HF
checkpoint's). RoPE data tensors become config: Llama-3.x's ``rope_freqs`` ``[D/2]`` (the
frequency divisors llama.cpp applies, ``RopeConfig.freq_factors``) and Phi-3's
``rope_factors_long`` / ``rope_factors_short`` (LongRoPE).
"""

from __future__ import annotations

import os

import numpy as np

from models import gguf_arch, gguf_file, hf_loader
from models import tokenizer as tokenizer_lib
from models.config import ModelConfig


def hf_name(gguf_name: str, arch: str = "llama") -> str:
  """llama.cpp tensor name -> Hugging Face name in a file of ``arch`` (raises on unknown
  names)."""
  try:
    return gguf_arch.ARCHS[arch].hf_name(gguf_name)
  except ValueError as e:
    raise hf_loader.CheckpointError(str(e)) from None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverts llama.cpp's Q/K row permutation.

  Args:
    w: ``[n_heads * D, ...]`` projection rows (or a bias ``[n_heads * D]``) in llama.cpp order:
      within a head, rotary pairs interleaved ``(x0, y0, x1, y1, ...)``.
    n_heads: query heads for Q, kv heads for K.

  Returns:
    The rows in half-split order ``(x0, x1, ..., y0, y1, ...)`` per head.
  """
  d = w.shape[0] // n_heads
  rest = w.shape[1:]
  return w.reshape(n_heads, d // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def config_from_metadata(meta: dict, names, side: dict, dtype: str = "float32") -> ModelConfig:
  """The ``ModelConfig`` a GGUF file describes (``gguf_arch.hf_config``: raises on unsupported
  architectures and on metadata keys this port does not implement).

  Args:
    meta: the file's metadata; names: its tensor names; side: its RoPE tensors
      (``rope_freqs``, ``rope_factors_long`` / ``_short``) as float32 arrays.
  """
  return ModelConfig.from_hf_config(gguf_arch.hf_config(meta, names, side), dtype=dtype)


class _Tensors:
  """A GGUF file's weights under Hugging Face names, in HF layout ``[out, in]``, float32: the
  ``safetensors_io.Checkpoint`` interface (``names``, ``shape``, ``read``) that
  ``hf_loader.split_fused`` reads, so Phi-3's fused ``attn_qkv`` / ``ffn_up`` split as the HF
  checkpoint's ``qkv_proj`` / ``gate_up_proj`` do."""

  def __init__(self, by_name: dict, spec: gguf_arch.Arch, config: ModelConfig):
    self._by_hf = {spec.hf_name(n): t for n, t in by_name.items()}
    self._spec, self._config = spec, config
    self._last = (None, None)  # a fused tensor is read once for its parts
    self.names = sorted(self._by_hf)

  def shape(self, name):
    return tuple(int(x) for x in reversed(self._by_hf[name].shape))

  def read(self, name, rows=None):
    from gguf import quants
    if self._last[0] != name:
      t = self._by_hf[name]
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
      w = w.reshape(self.shape(name))
      if self._spec.permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
        w = unpermute_rows(w, self._config.num_heads)
      elif self._spec.permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
        w = unpermute_rows(w, self._config.num_kv_heads)
      if self._spec.norm_plus_one and name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
      self._last = (name, w)
    w = self._last[1]
    return w if rows is None else w[rows[0]:rows[1]]


def load_gguf(path: str, dtype: str = "float32"):
  """Reads a GGUF file.

  Returns:
    ``(config, params, tokenizer)`` with numpy params (float32 unless ``dtype`` says otherwise).
  """
  from gguf import quants

  if not os.path.exists(path):
    raise FileNotFoundError(f"GGUF file {path} does not exist")
  meta, tensors = gguf_file.read(path)
  _, spec = gguf_arch.arch_of(meta)
  by_name = {t.name: t for t in tensors}
  side = {}
  for name in spec.side_tensors:
    if name in by_name:
      t = by_name.pop(name)
      side[name] = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
  config = config_from_metadata(meta, by_name, side, dtype)
  try:
    tensors = _Tensors(by_name, spec, config)
  except ValueError as e:
    raise hf_loader.CheckpointError(str(e)) from None
  names, get = hf_loader.split_fused(config, tensors)
  params = hf_loader.convert_state_dict(config, get, names)
  tok = tokenizer_lib.from_gguf_metadata(meta)
  return config, params, tok
