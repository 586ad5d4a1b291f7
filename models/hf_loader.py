"""Hugging Face checkpoint -> our params (the one name-mapping table every loader uses).

``convert_state_dict`` maps HF tensor names (``model.layers.{i}.self_attn.q_proj.weight`` ...)
to the stacked Flax params of ``models.llama``; the GGUF loader renames llama.cpp tensors to
HF names first and then comes through here too.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import jax
import numpy as np

from models import llama
from models.config import ModelConfig

# HF per-layer name (after "model.layers.{i}.") -> (our module, our param, transpose)
LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm", "scale", False),
    "post_attention_layernorm.weight": ("mlp_norm", "scale", False),
    "self_attn.q_proj.weight": ("q_proj", "kernel", True),
    "self_attn.k_proj.weight": ("k_proj", "kernel", True),
    "self_attn.v_proj.weight": ("v_proj", "kernel", True),
    "self_attn.o_proj.weight": ("o_proj", "kernel", True),
    "self_attn.q_proj.bias": ("q_proj", "bias", False),
    "self_attn.k_proj.bias": ("k_proj", "bias", False),
    "self_attn.v_proj.bias": ("v_proj", "bias", False),
    "self_attn.o_proj.bias": ("o_proj", "bias", False),
    "mlp.gate_proj.weight": ("gate_proj", "kernel", True),
    "mlp.up_proj.weight": ("up_proj", "kernel", True),
    "mlp.down_proj.weight": ("down_proj", "kernel", True),
    "mlp.gate_proj.bias": ("gate_proj", "bias", False),
    "mlp.up_proj.bias": ("up_proj", "bias", False),
    "mlp.down_proj.bias": ("down_proj", "bias", False),
    "self_attn.q_norm.weight": ("q_norm", "scale", False),
    "self_attn.k_norm.weight": ("k_norm", "scale", False),
}
# Gemma 2 / 3 (``config.sandwich_norms``): four norms per layer, ``mlp_norm`` being the one
# before the MLP (Llama's ``post_attention_layernorm`` is Gemma's ``pre_feedforward_layernorm``).
SANDWICH_NORMS = {
    "post_attention_layernorm.weight": ("post_attn_norm", "scale", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", "scale", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", "scale", False),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def layer_map(config: ModelConfig) -> dict:
  """HF per-layer name -> (our module, our param, transpose) for ``config``'s block."""
  if not config.sandwich_norms:
    return LAYER_MAP
  return {**{k: v for k, v in LAYER_MAP.items() if k != "post_attention_layernorm.weight"},
          **SANDWICH_NORMS}
# Phi-3's fused HF tensors (per layer) -> the parts they concatenate on the output axis.
FUSED_MAP = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


class CheckpointError(ValueError):
  """A checkpoint does not match the config (missing, unexpected or mis-shaped tensor)."""


def expected_shapes(config: ModelConfig):
  """The params pytree of ``config`` as ``jax.ShapeDtypeStruct`` leaves."""
  return jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))


def convert_state_dict(config: ModelConfig, tensors: Mapping[str, np.ndarray] | Callable,
                       names=None) -> llama.Params:
  """Builds our params from HF-named tensors.

  Args:
    config: the model config.
    tensors: ``name -> array [out, in]`` (HF layout), or a callable ``name -> array``.
    names: the available names (default ``tensors.keys()``).

  Returns:
    numpy params in ``config.dtype`` with the layer axis stacked.

  Raises:
    CheckpointError: missing or unexpected tensors, or a shape mismatch (names both shapes).
  """
  get = tensors if callable(tensors) else tensors.__getitem__
  names = set(tensors.keys() if names is None else names)
  want = expected_shapes(config)
  dtype = np.dtype(llama.compute_dtype(config))
  used = set()

  def fetch(name, shape, transpose=False):
    if name not in names:
      raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    used.add(name)
    arr = np.asarray(get(name))
    arr = arr.T if transpose else arr
    if tuple(arr.shape) != tuple(shape):
      raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)} (after transpose: "
                            f"{transpose}), the config expects {tuple(shape)}")
    return arr.astype(dtype if arr.ndim > 1 or "norm" not in name else np.float32)

  params = {"embed": fetch("model.embed_tokens.weight", want["embed"].shape),
            "final_norm": {"scale": fetch("model.norm.weight", want["final_norm"]["scale"].shape)}}
  if not config.tie_word_embeddings:
    params["lm_head"] = fetch("lm_head.weight", want["lm_head"].shape, transpose=True)
  elif "lm_head.weight" in names:
    used.add("lm_head.weight")  # tied: a saved copy of the embedding is redundant
  layers = {}
  names_of = layer_map(config)
  for module, leaves in want["layers"].items():
    layers[module] = {}
    for leaf, sd in leaves.items():
      hf = next(k for k, v in names_of.items() if v[:2] == (module, leaf))
      transpose = names_of[hf][2]
      per = [fetch(f"model.layers.{i}.{hf}", sd.shape[1:], transpose)
             for i in range(config.num_layers)]
      layers[module][leaf] = np.stack(per)
  params["layers"] = layers
  extra = sorted(n for n in names - used if not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    raise CheckpointError(f"checkpoint has tensors the config does not use: {extra[:8]}"
                          f"{' ...' if len(extra) > 8 else ''} (check config.json)")
  return params


def split_fused(config: ModelConfig, names, get):
  """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` tensors seen as their parts.

  Args:
    names: the checkpoint's tensor names; get: ``name -> array``.

  Returns:
    ``(names, get)`` with every ``FUSED_MAP`` tensor replaced by its parts (rows
    ``[q | k | v]`` of sizes ``N*D, K*D, K*D``; ``[gate | up]`` of ``F`` each, transformers'
    ``Phi3Attention`` / ``Phi3MLP`` order); each part reads its fused tensor (lazily).
  """
  sizes = {"self_attn.qkv_proj.weight": (config.q_size, config.kv_size, config.kv_size),
           "mlp.gate_up_proj.weight": (config.intermediate_size,) * 2}
  parts = {}  # part name -> (fused name, row start, row stop, fused rows)
  for name in names:
    prefix, _, rest = name.rpartition("layers.")
    layer, _, suffix = rest.partition(".")
    if prefix and suffix in FUSED_MAP:
      start = 0
      for part, size in zip(FUSED_MAP[suffix], sizes[suffix], strict=True):
        parts[f"{prefix}layers.{layer}.{part}"] = (name, start, start + size, sum(sizes[suffix]))
        start += size
  if not parts:
    return names, get
  fused = {src for src, *_ in parts.values()}

  def get_split(name):
    if name not in parts:
      return get(name)
    src, start, stop, rows = parts[name]
    arr = np.asarray(get(src))
    if arr.shape[0] != rows:
      raise CheckpointError(f"tensor {src!r} has shape {tuple(arr.shape)}, the config expects "
                            f"{rows} rows")
    return arr[start:stop]

  return sorted((set(names) - fused) | set(parts)), get_split


def read_safetensors(path: str):
  """Lazily reads an HF directory's safetensors (single file or sharded with an index).

  Returns:
    ``(names, get)`` where ``get(name)`` loads one tensor as numpy.
  """
  from safetensors import safe_open

  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = {n: os.path.join(path, fn) for n, fn in weight_map.items()}
    for fn in set(files.values()):
      if not os.path.exists(fn):
        raise FileNotFoundError(f"shard {fn} listed in {index} is missing")
  elif os.path.exists(single):
    with safe_open(single, framework="np") as f:
      files = {n: single for n in f.keys()}
  else:
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
  handles = {}

  def get(name):
    fn = files[name]
    if fn not in handles:
      handles[fn] = safe_open(fn, framework="flax")
    return np.asarray(handles[fn].get_tensor(name))

  return sorted(files), get


def load_hf_dir(path: str, dtype: str = "float32"):
  """Loads ``config.json`` + safetensors from an HF directory.

  Returns:
    ``(config, params)`` with numpy params.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model dir)")
  with open(cfg_path) as f:
    config = ModelConfig.from_hf_config(json.load(f), dtype=dtype)
  names, get = split_fused(config, *read_safetensors(path))
  return config, convert_state_dict(config, get, names)
