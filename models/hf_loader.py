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

from models import llama, safetensors_io
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


def tensor_plan(config: ModelConfig):
  """Every HF tensor ``config`` reads: ``(hf name, our path, layer or None, transpose, struct)``.

  ``our path`` is the key path into the params (``("layers", "q_proj", "kernel")``), ``layer``
  the index on the stacked layer axis, ``struct`` the ``ShapeDtypeStruct`` of the whole leaf.
  """
  want = expected_shapes(config)
  plan = [("model.embed_tokens.weight", ("embed",), None, False, want["embed"]),
          ("model.norm.weight", ("final_norm", "scale"), None, False, want["final_norm"]["scale"])]
  if not config.tie_word_embeddings:
    plan.append(("lm_head.weight", ("lm_head",), None, True, want["lm_head"]))
  names_of = layer_map(config)
  for module, leaves in want["layers"].items():
    for leaf, sd in leaves.items():
      hf = next(k for k, v in names_of.items() if v[:2] == (module, leaf))
      plan += [(f"model.layers.{i}.{hf}", ("layers", module, leaf), i, names_of[hf][2], sd)
               for i in range(config.num_layers)]
  return plan


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """HF name -> shape (HF layout ``[out, in]``) of every tensor a checkpoint of ``config``
  holds (Phi-3's projections unfused)."""
  out = {}
  for name, _, layer, transpose, sd in tensor_plan(config):
    shape = sd.shape[1:] if layer is not None else sd.shape
    out[name] = tuple(reversed(shape)) if transpose else tuple(shape)
  return out


def convert_state_dict(config: ModelConfig, tensors: Mapping[str, np.ndarray] | Callable,
                       names=None) -> llama.Params:
  """Builds our params from HF-named tensors, one tensor at a time.

  Each leaf is allocated once, 64-byte aligned, in its final dtype (``config.dtype``; norms
  float32) and filled tensor by tensor (a layer's tensor is cast into its slot of the stacked
  leaf), so the peak is the params plus the tensor being read: never a float32 copy of a
  bfloat16 model, nor per-layer copies beside their stack. On a CPU ``jax.device_put`` then
  hands these very buffers to XLA (it aliases 64-byte aligned host arrays).

  Args:
    config: the model config.
    tensors: ``name -> array [out, in]`` (HF layout), or a callable ``name -> array`` whose
      arrays are new (an aligned one of the right dtype becomes a leaf as it is).
    names: the available names (default ``tensors.keys()``).

  Returns:
    numpy params in ``config.dtype`` with the layer axis stacked.

  Raises:
    CheckpointError: missing or unexpected tensors, or a shape mismatch (names both shapes).
  """
  get = tensors if callable(tensors) else tensors.__getitem__
  fresh = callable(tensors)  # a reader's arrays are new: kept as they are, never a dict's
  names = set(tensors.keys() if names is None else names)
  params, used = {}, set()
  for name, path, layer, transpose, sd in tensor_plan(config):
    shape = sd.shape[1:] if layer is not None else sd.shape
    if name not in names:
      raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    used.add(name)
    arr = np.asarray(get(name))
    arr = arr.T if transpose else arr
    if tuple(arr.shape) != tuple(shape):
      raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)} (after transpose: "
                            f"{transpose}), the config expects {tuple(shape)}")
    *parents, key = path
    node = params
    for p in parents:
      node = node.setdefault(p, {})
    if fresh and layer is None and arr.dtype == sd.dtype and safetensors_io.is_aligned(arr):
      node[key] = arr  # read straight into its final buffer
      continue
    if key not in node:
      node[key] = safetensors_io.aligned_empty(sd.shape, sd.dtype)
    if layer is None:
      node[key][...] = arr
    else:
      node[key][layer] = arr
    del arr  # before the next read
  if config.tie_word_embeddings and "lm_head.weight" in names:
    used.add("lm_head.weight")  # tied: a saved copy of the embedding is redundant
  extra = sorted(n for n in names - used if not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    raise CheckpointError(f"checkpoint has tensors the config does not use: {extra[:8]}"
                          f"{' ...' if len(extra) > 8 else ''} (check config.json)")
  return params


def split_fused(config: ModelConfig, ckpt: safetensors_io.Checkpoint):
  """The checkpoint's tensors with Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` seen as parts.

  Args:
    config: the model config.
    ckpt: the checkpoint.

  Returns:
    ``(names, get)``: the tensor names with every ``FUSED_MAP`` tensor replaced by its parts
    (rows ``[q | k | v]`` of sizes ``N*D, K*D, K*D``; ``[gate | up]`` of ``F`` each,
    transformers' ``Phi3Attention`` / ``Phi3MLP`` order), and ``get: name -> array`` that
    reads a part's rows only.
  """
  sizes = {"self_attn.qkv_proj.weight": (config.q_size, config.kv_size, config.kv_size),
           "mlp.gate_up_proj.weight": (config.intermediate_size,) * 2}
  parts = {}  # part name -> (fused name, row start, row stop)
  for name in ckpt.names:
    prefix, _, rest = name.rpartition("layers.")
    layer, _, suffix = rest.partition(".")
    if prefix and suffix in FUSED_MAP:
      rows = sum(sizes[suffix])
      if ckpt.shape(name)[0] != rows:
        raise CheckpointError(f"tensor {name!r} has shape {ckpt.shape(name)}, the config "
                              f"expects {rows} rows")
      start = 0
      for part, size in zip(FUSED_MAP[suffix], sizes[suffix], strict=True):
        parts[f"{prefix}layers.{layer}.{part}"] = (name, start, start + size)
        start += size
  fused = {src for src, *_ in parts.values()}

  def get(name):
    if name not in parts:
      return ckpt.read(name)
    src, start, stop = parts[name]
    return ckpt.read(src, rows=(start, stop))

  return sorted((set(ckpt.names) - fused) | set(parts)), get


def load_hf_dir(path: str, dtype: str = "float32"):
  """Loads ``config.json`` + safetensors from an HF directory, one tensor at a time.

  Returns:
    ``(config, params)`` with numpy params (see ``convert_state_dict``).
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model dir)")
  with open(cfg_path) as f:
    config = ModelConfig.from_hf_config(json.load(f), dtype=dtype)
  with safetensors_io.Checkpoint(path) as ckpt:
    names, get = split_fused(config, ckpt)
    return config, convert_state_dict(config, get, names)

