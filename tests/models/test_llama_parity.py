"""Logits of the Flax port vs transformers on tiny random checkpoints (float32)."""

import json
import shutil

import numpy as np
import pytest

import models
from models import hf_loader
from models.config import ModelConfig
from tests.models import tiny

TOKENS = np.random.default_rng(1).integers(0, tiny.BASE["vocab_size"], (2, 24))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """``name -> (path, transformers' logits of TOKENS)`` for every tiny config, all computed
  in one child process (``tiny.references``)."""
  root = tmp_path_factory.mktemp("hf")
  names = sorted(tiny.CONFIGS)
  refs = tiny.references([(n, root / n, {"f32": tiny.logits(TOKENS)}, {}) for n in names])
  return {n: (str(root / n), r["f32"]) for n, r in zip(names, refs)}


@pytest.mark.parametrize("name", sorted(tiny.CONFIGS))
def test_logits_match_transformers(name, hf):
  path, ref = hf[name]
  model = models.load(path)
  tokens = TOKENS
  ours = np.asarray(model.forward(tokens))
  assert ours.shape == ref.shape
  assert tiny.rel_error(ours, ref) <= 1e-4


def test_phi3_su_config_reads_as_longrope():
  """A Phi-3-mini-128k-style config.json (``rope_scaling.type = "su"``, top-level
  ``original_max_position_embeddings``)."""
  cfg = ModelConfig.from_hf_config(_hf_config(
      model_type="phi3", max_position_embeddings=131072, original_max_position_embeddings=4096,
      rope_theta=10000.0, rope_scaling=dict(type="su", short_factor=[1.0, 1.5],
                                            long_factor=[2.0, 4.0])))
  assert cfg.rope.rope_type == "longrope" and cfg.rope.factor == 32.0
  assert cfg.rope.attention_factor == pytest.approx(1.1902380714238083)  # Phi-3-mini-128k's
  assert cfg.rope.for_context(4096).longrope_long is False
  assert cfg.rope.for_context(4097).longrope_long is True


def test_config_fields(hf):
  cfg = models.load(hf["qwen2"][0]).config
  assert cfg.model_type == "qwen2" and cfg.qkv_bias and not cfg.o_bias
  assert not cfg.tie_word_embeddings and cfg.rope.theta == 1e6
  assert cfg.group_size == 2


def _hf_config(**kw):
  base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
  return {**base, **kw}


@pytest.mark.parametrize("bad, match", [
    (dict(model_type="gpt2"), "unsupported model_type"),
    (dict(some_new_option=True), "some_new_option"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "yarn"),
    (dict(rope_scaling=dict(rope_type="linear", factor=2.0, beta=1)), "beta"),
    (dict(model_type="qwen2", use_sliding_window=True), "sliding"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=4), "sliding"),
    (dict(model_type="phi3", partial_rotary_factor=0.75), "partial_rotary_factor"),
    (dict(model_type="phi3", rope_parameters=dict(rope_type="default",
                                                  partial_rotary_factor=0.5)), "partial"),
    (dict(model_type="phi3", rope_scaling=dict(type="su", short_factor=[1.0] * 2,
                                               long_factor=[1.0] * 3)), "long_factor"),
    (dict(model_type="gemma3"), "unsupported model_type"),  # the multimodal wrapper
    (dict(model_type="gemma2", use_bidirectional_attention=True), "bidirectional"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "Gemma3Attention"),
    (dict(query_pre_attn_scalar=256), "query_pre_attn_scalar"),  # a Gemma key on Llama
])
def test_unsupported_options_raise(bad, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.from_hf_config(_hf_config(**bad))


def test_shape_mismatch_names_tensor(hf, tmp_path):
  tmp_path = tmp_path / "llama_gqa_tied"
  shutil.copytree(hf["llama_gqa_tied"][0], tmp_path)  # the module's copy stays intact
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 120
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(hf_loader.CheckpointError, match=r"mlp\.(gate|up|down)_proj.*112.*120"):
    models.load(str(tmp_path))


def test_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="neither a known model name"):
    models.load(str(tmp_path / "nope"))
  (tmp_path / "config.json").write_text(json.dumps(_hf_config()))
  with pytest.raises(FileNotFoundError, match="safetensors"):
    models.load(str(tmp_path))
