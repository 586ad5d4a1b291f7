"""Loading a bfloat16 checkpoint holds its weights once (issue 53, item 4).

A synthetic sharded checkpoint in Llama-3.1-8B's layout (``experiments.load_memory.SMALL``,
0.57 GB) is written by the test and loaded in a fresh process that reads its own peak resident
set (``VmHWM``). Measured on the 2-core CI machine: ``(peak - baseline) / checkpoint bytes`` =
1.02 (2.54 before the loader read tensor by tensor into aligned buffers that ``device_put``
aliases); the float32 load of the same checkpoint is 2.0 (its params are twice the size).
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import models
from experiments import load_memory
from models import hf_loader, safetensors_io, shapes, synthetic_checkpoint


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
  path = tmp_path_factory.mktemp("small_ckpt")
  size = synthetic_checkpoint.write(load_memory.small_config(), str(path),
                                    max_shard_bytes=200 << 20)
  return str(path), size


def test_bfloat16_load_peak_is_the_checkpoint_size(small_ckpt):
  path, size = small_ckpt
  assert len(json.load(open(f"{path}/model.safetensors.index.json"))["weight_map"]) == 16 * 9 + 3
  rec = load_memory.measure(path, "bfloat16")
  ratio = (rec["peak_bytes"] - rec["baseline_bytes"]) / size
  # The weights once, plus transients of one tensor (the transposed LM head: 0.12 here).
  assert ratio < 1.2, rec
  assert (rec["rss_after_bytes"] - rec["baseline_bytes"]) / size < 1.1, rec


def _reference(path, name):
  """Tensor ``name`` read by safetensors itself (as float32)."""
  index = json.load(open(f"{path}/model.safetensors.index.json"))["weight_map"]
  with safe_open(f"{path}/{index[name]}", framework="flax") as f:
    return np.asarray(f.get_tensor(name), np.float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_loaded_params_equal_the_checkpoint(tmp_path, dtype):
  cfg = shapes.hf_config("tiny")
  synthetic_checkpoint.write(cfg, str(tmp_path), max_shard_bytes=20_000)
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  model = models.load(str(tmp_path), dtype=dtype)
  params = model.params
  assert params["embed"].dtype == dtype and params["layers"]["attn_norm"]["scale"].dtype == "float32"
  np.testing.assert_array_equal(np.asarray(params["lm_head"], np.float32),
                                _reference(tmp_path, "lm_head.weight").T)
  np.testing.assert_array_equal(np.asarray(params["embed"], np.float32),
                                _reference(tmp_path, "model.embed_tokens.weight"))
  for i in range(cfg["num_hidden_layers"]):
    np.testing.assert_array_equal(np.asarray(params["layers"]["gate_proj"]["kernel"][i], np.float32),
                                  _reference(tmp_path, f"model.layers.{i}.mlp.gate_proj.weight").T)
  assert np.isfinite(np.asarray(model.forward(np.arange(6)[None]))).all()


def test_checkpoint_reads_rows_and_refuses_damage(tmp_path):
  a = np.arange(24, dtype=np.float32).reshape(6, 4).astype(ml_dtypes.bfloat16)
  specs = {"a": (a.shape, a.dtype), "b": ((3,), np.dtype(np.int32))}
  fill = {"a": a, "b": np.array([1, 2, 3], np.int32)}.__getitem__
  safetensors_io.write_file(str(tmp_path / "model.safetensors"), specs, fill)
  with safetensors_io.Checkpoint(str(tmp_path)) as ckpt:
    assert ckpt.names == ["a", "b"] and ckpt.shape("a") == (6, 4)
    got = ckpt.read("a", rows=(2, 5))
    np.testing.assert_array_equal(got, a[2:5])
    assert safetensors_io.is_aligned(got) and got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(ckpt.read("b"), [1, 2, 3])
  with safe_open(str(tmp_path / "model.safetensors"), framework="flax") as f:  # the real format
    np.testing.assert_array_equal(np.asarray(f.get_tensor("a")), a)
  raw = (tmp_path / "model.safetensors").read_bytes()
  (tmp_path / "model.safetensors").write_bytes(raw[:-4])
  with safetensors_io.Checkpoint(str(tmp_path)) as ckpt, pytest.raises(ValueError, match="ends"):
    ckpt.read("b")


def test_device_put_aliases_the_loaded_buffers():
  """What the peak rests on: XLA's CPU client takes an aligned host array without a copy."""
  if jax.default_backend() != "cpu":
    pytest.skip("aliasing is a CPU property")
  x = safetensors_io.aligned_empty((4, 64), ml_dtypes.bfloat16)
  x[...] = 1
  y = jax.device_put(x)
  x[0, 0] = 7  # never done by the loader: here it shows y is the same memory
  assert float(y[0, 0]) == 7
  assert hf_loader.hf_tensor_shapes(shapes.model_config("tiny", "bfloat16"))[
      "model.layers.0.self_attn.k_proj.weight"] == (32, 64)
