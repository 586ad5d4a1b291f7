"""A synthetic Hugging Face checkpoint of any shape, written to disk tensor by tensor.

``write(hf_config, path)`` saves ``config.json`` and the tensors a checkpoint of that config
holds (names and ``[out, in]`` shapes from ``hf_loader.hf_tensor_shapes``), sharded like
``save_pretrained`` (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``).
Values are a random block tiled over each tensor (finite, cheap to make): what this is for is
the loader's memory and time on a checkpoint of a real size, not the weights' statistics.
"""

from __future__ import annotations

import json
import os

import numpy as np

from models import hf_loader, safetensors_io
from models.config import ModelConfig

_BLOCK = 1 << 16  # distinct random values per tensor


def write(hf_config: dict, path: str, *, dtype: str = "bfloat16", max_shard_bytes: int = 1 << 30,
          seed: int = 0) -> int:
  """Writes a random checkpoint of ``hf_config`` (a ``config.json`` dict) into ``path``.

  Args:
    hf_config: the config (``models.shapes.hf_config(name)`` or any supported ``config.json``).
    path: the directory (created).
    dtype: the tensors' dtype (``torch_dtype`` of the config written).
    max_shard_bytes: at most this many bytes of tensors per shard (a larger tensor alone).
    seed: random seed.

  Returns:
    The bytes of tensor data written (the checkpoint's size without headers).
  """
  config = ModelConfig.from_hf_config(hf_config, dtype=dtype)
  np_dtype = np.dtype(safetensors_io.DTYPES[{"bfloat16": "BF16", "float16": "F16",
                                             "float32": "F32"}[dtype]])
  specs = {name: (shape, np_dtype) for name, shape in hf_loader.hf_tensor_shapes(config).items()}
  rng = np.random.default_rng(seed)

  def fill(name):
    shape, _ = specs[name]
    size = int(np.prod(shape, dtype=np.int64))
    block = (rng.standard_normal(min(size, _BLOCK), np.float32) * 0.02).astype(np_dtype)
    if name.endswith("norm.weight"):
      block = np.ones_like(block)
    return np.resize(block, shape)

  os.makedirs(path, exist_ok=True)
  shards = list(safetensors_io.shard(specs, max_shard_bytes))
  weight_map, total = {}, 0
  for i, group in enumerate(shards):
    filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors_io.write_file(os.path.join(path, filename), group, fill)
    weight_map.update(dict.fromkeys(group, filename))
    total += sum(int(np.prod(s, dtype=np.int64)) * np_dtype.itemsize for s, _ in group.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump({**hf_config, "torch_dtype": dtype}, f, indent=1)
  return total
