"""Gemma 2, Gemma 3 (text) and Phi-3 from GGUF (issue 53 item 1): llama.cpp's names, metadata
and conventions (``models.gguf_arch``).

Each tiny random transformers checkpoint is written as llama.cpp's converter would write it
(``gguf_writer``: gguf-py's own tensor-name table, Gemma's norms as ``1 + w``, Phi-3's fused
``attn_qkv`` / ``ffn_up`` and LongRoPE factor tensors) and loaded back: its logits equal our load
of the HF directory, so the mapping is the identity on the model. The checkpoints are built
once per module, in one child process.
"""

import json
import shutil

import numpy as np
import pytest

import models
from models import gguf_arch, gguf_loader
from tests.models import gguf_writer, tiny

VOCAB = 300  # the writer's byte-level tokenizer needs >= 258 ids
# llama.cpp has no key for query_pre_attn_scalar: it is head_dim (16) outside the 27B shapes.
GEMMA = dict(vocab_size=VOCAB, query_pre_attn_scalar=16)
# name -> (tiny config, llama.cpp architecture, overrides); Phi-3 with LongRoPE and a window.
CASES = {"gemma2": ("gemma2", "gemma2", GEMMA),
         "gemma3": ("gemma3_text", "gemma3", GEMMA),
         "phi3": ("phi3_longrope", "phi3", dict(vocab_size=VOCAB, sliding_window=8))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """name -> (HF directory, GGUF path)."""
  root = tmp_path_factory.mktemp("gguf_families")
  specs = [(cfg, root / name, over) for name, (cfg, _, over) in CASES.items()]
  dirs = tiny.make_many(specs)
  out = {}
  for (name, (_, arch, _)), hf in zip(CASES.items(), dirs):
    gguf_writer.write_gguf(hf, root / f"{name}.gguf", arch)
    out[name] = (hf, str(root / f"{name}.gguf"))
  return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_the_hf_directory_load(name, checkpoints):
  hf_dir, path = checkpoints[name]
  ours, ref = models.load(path, use_cache=False), models.load(hf_dir)
  a, b = ours.config, ref.config
  assert a.model_type == b.model_type
  for field in ("sliding_window", "sliding_layers", "attn_softcap", "final_softcap",
                "query_pre_attn_scalar", "local_rope", "tie_word_embeddings", "qk_norm",
                "norm_plus_one", "sandwich_norms"):
    assert getattr(a, field) == getattr(b, field), field
  assert (a.rope.rope_type, a.rope.theta, a.rope.factor) == (
      b.rope.rope_type, b.rope.theta, b.rope.factor)
  if name == "phi3":
    assert a.rope.rope_type == "longrope" and a.sliding_window == 8
    np.testing.assert_allclose(a.rope.attention_factor, b.rope.attention_factor, rtol=1e-6)
    assert a.rope.long_factor == pytest.approx(b.rope.long_factor, rel=1e-6)
  tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 24))  # > window and LongRoPE's 16
  got, want = np.asarray(ours.forward(tokens)), np.asarray(ref.forward(tokens))
  assert tiny.rel_error(got, want) <= 1e-6  # measured: 0 (bit-identical)
  for p, q in zip(*(jax_leaves(m.params) for m in (ours, ref))):
    np.testing.assert_allclose(p, q, rtol=0, atol=1e-6)  # Gemma's (1 + w) - 1


def jax_leaves(params):
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def _meta(arch, **keys):
  base = {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"] * 8,
          f"{arch}.block_count": 4, f"{arch}.embedding_length": 64,
          f"{arch}.feed_forward_length": 96, f"{arch}.attention.head_count": 4,
          f"{arch}.attention.key_length": 32, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
  return {**base, **{f"{arch}.{k}": v for k, v in keys.items()}}


def test_metadata_conventions():
  cfg = gguf_arch.hf_config(_meta("gemma2"), [], {})  # llama.cpp's Gemma 2 defaults
  assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
  assert cfg["sliding_window"] == 4096 and cfg["query_pre_attn_scalar"] == 32
  assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
  big = gguf_arch.hf_config(_meta("gemma2", block_count=46), [], {})  # the 27B shape
  assert big["query_pre_attn_scalar"] == 64 // 4
  g3 = gguf_arch.hf_config(_meta("gemma3", block_count=7, **{"attention.sliding_window": 16}),
                           [], {})
  assert g3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + [
      "sliding_attention"]
  assert g3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
  assert g3["final_logit_softcapping"] is None
  flat = gguf_arch.hf_config(_meta("gemma3"), [], {})  # no window: every layer global
  assert flat["sliding_window"] is None and set(flat["layer_types"]) == {"full_attention"}
  phi = gguf_arch.hf_config(_meta("phi3", **{"attention.sliding_window": 0}), ["output.weight"],
                            {})
  assert phi["sliding_window"] is None and not phi["tie_word_embeddings"]


@pytest.mark.parametrize("arch, keys, side, match", [
    ("gemma2", {"attention.scale": 0.1}, {}, "does not implement.*gemma2.attention.scale"),
    ("llama", {"attention.sliding_window": 8}, {}, "does not implement"),
    ("phi3", {"rope.scaling.original_context_length": 8}, {"rope_factors_long.weight": [1.0]},
     "only one of"),
    ("phi3", {"rope.scaling.attn_factor": 1.2}, {}, "no LongRoPE"),
    ("gemma2", {"rope.scaling.type": "yarn"}, {}, "yarn"),
    ("gemma3", {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True]}, {},
     "1 entries for 4 layers"),
    ("gemma2", {"attention.value_length": 16}, {}, "value_length"),
    ("falcon", {}, {}, "architecture 'falcon' is not supported"),
])
def test_unsupported_fields_raise(arch, keys, side, match):
  with pytest.raises(ValueError, match=match):
    gguf_arch.hf_config(_meta(arch, **keys), [], side)


def test_refusals_on_files(checkpoints, tmp_path):
  with pytest.raises(ValueError, match="not supported"):  # Gemma 3 has no attention soft-cap
    gguf_loader.config_from_metadata(_meta("gemma3", attn_logit_softcapping=30.0), [], {})
  with pytest.raises(ValueError, match="no known HF equivalent"):
    gguf_arch.ARCHS["gemma2"].hf_name("blk.0.attn_q.bias")
  hf_dir, _ = checkpoints["gemma2"]  # a query_pre_attn_scalar llama.cpp cannot express
  shutil.copytree(hf_dir, tmp_path / "hf")
  cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
  (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "query_pre_attn_scalar": 4}))
  with pytest.raises(ValueError, match="query_pre_attn_scalar"):
    gguf_writer.write_gguf(tmp_path / "hf", tmp_path / "m.gguf", "gemma2")
