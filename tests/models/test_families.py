"""Qwen3 and Phi-3 (issue 53) against transformers, and every kind of method on them.

Float32 logits of every family are checked in ``test_llama_parity`` (``tiny.CONFIGS``); here:
greedy decoding, bfloat16, LongRoPE's short/long switch, sharded checkpoints, and a selector,
an enhancer and a compression method at full budget equal to dense through the decode loop.
On a sliding-window model (``phi3_window``) a selector ranks and reads only the blocks inside
the window (``with_model_window``) and a compression method attends and scores under it; RESA
has no window mask and is refused, as on Mistral (``test_sliding_window``). Gemma 2 / 3 are in
``test_gemma``.
"""

import math
import pathlib

import numpy as np
import pytest

import models
from models import decode, llama
from sparse_attn import methods
from tests.models import tiny

PROMPT_LEN = 9
KW = dict(prefill_chunk=4, capacity=32)
TEACHER_FORCED = (tiny.LONGROPE_ORIGINAL, 26)
LONGROPE_SWITCH = (tiny.LONGROPE_ORIGINAL, tiny.LONGROPE_ORIGINAL + 1)  # short, then long


_tokens = tiny.random_tokens
SHARDED = ("phi3_window", "gemma3_text")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """``name -> (path, references)``: every checkpoint of this module and every transformers
  reference its tests compare with, computed in one child process (``tiny.references``);
  ``name + "@40KB"``: the checkpoint saved in 40 KB shards."""
  root = tmp_path_factory.mktemp("hf")
  specs = []
  for name in tiny.NEW_FAMILIES:
    requests = {"greedy": tiny.greedy(_tokens(1, tiny.LONGROPE_ORIGINAL + 1), 8),
                "f32_24": tiny.logits(_tokens(2, 24)),
                "bf16_24": tiny.logits(_tokens(2, 24), "bfloat16")}
    for n in TEACHER_FORCED:
      requests[f"f32_{n}"] = tiny.logits(_tokens(2, n))
    if name == "phi3_longrope":
      for n in LONGROPE_SWITCH:
        requests[f"switch_{n}"] = tiny.logits(_tokens(1, n, seed=n))
      requests["greedy_short"] = tiny.greedy(_tokens(1, PROMPT_LEN), 7)
    specs.append((name, root / name, requests, {}))
  for name in SHARDED:
    specs.append((name, root / f"{name}_sharded", {"f32_20": tiny.logits(_tokens(1, 20))},
                  dict(max_shard_size="40KB")))
  refs = tiny.references(specs)
  keys = list(tiny.NEW_FAMILIES) + [f"{name}@40KB" for name in SHARDED]
  return {k: (str(spec[1]), r) for k, spec, r in zip(keys, specs, refs)}


@pytest.fixture(scope="module", params=tiny.NEW_FAMILIES)
def family(request, hf):
  """``(name, path, model, references)``."""
  path, refs = hf[request.param]
  return request.param, path, models.load(path), refs


def test_greedy_generate_matches_transformers(family):
  """A prompt past phi3_window's window and phi3_longrope's original length (17 > 16: the
  long factors throughout, in transformers and in a run of this capacity)."""
  _, _, model, refs = family
  prompt = _tokens(1, tiny.LONGROPE_ORIGINAL + 1)
  want = refs["greedy"]
  out = decode.generate(model, prompt[0].tolist(), 8, methods.make("dense", block_size=4),
                        stop_at_eos=False, **KW)
  assert out.tokens[0] == want


@pytest.mark.parametrize("n", TEACHER_FORCED)
def test_teacher_forced_matches_transformers(family, n):
  """A cache of 16 positions (LongRoPE's short factors) and of 28 (the long ones), as
  transformers' forward over 16 and 26 tokens."""
  _, _, model, refs = family
  tokens = _tokens(2, n)
  ref = refs[f"f32_{n}"]
  got = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                              prefill_chunk=4)
  assert tiny.rel_error(got, ref[:, PROMPT_LEN - 1:]) <= 1e-4


def test_bfloat16_logits_close(family):
  _, path, _, refs = family
  model = models.load(path, dtype="bfloat16")
  tokens = _tokens(2, 24)
  got = np.asarray(model.forward(tokens))
  assert tiny.rel_error(got, refs["f32_24"]) <= 3e-2
  assert tiny.rel_error(got, refs["bf16_24"]) <= 3e-2


def test_full_budget_methods_equal_dense(family):
  name, _, model, _ = family
  tokens = _tokens(1, 26, seed=5)
  run = lambda m: decode.teacher_forced(model, tokens, 13, m, **KW)
  dense = run(methods.make("dense", block_size=4))
  specs = {"quest": dict(budget=1.0, block_size=4),
           "resa-quest": dict(budget=1.0, block_size=4),
           "snapkv": dict(ratio=0.0)}
  for spec, options in specs.items():
    m = methods.make(spec, **options)
    if model.config.sliding_window is not None and spec == "resa-quest":
      with pytest.raises(NotImplementedError, match="sliding-window"):
        run(m)
      continue
    np.testing.assert_allclose(run(m), dense, rtol=1e-4, atol=1e-4, err_msg=f"{name} {spec}")


def test_fused_decode_layout_equals_loaded(family):
  """The GPU decode layout (q/k/v and gate/up fused) keeps Qwen3's q/k norms and reads
  Phi-3's split projections back in transformers' order."""
  _, _, model, _ = family
  fused = models.Model(model.config, llama.decode_layout(model.params, fuse=True), None)
  assert llama.is_fused(fused.params["layers"])
  tokens = _tokens(1, 20)
  got = decode.teacher_forced(fused, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                              prefill_chunk=4)
  want = np.asarray(model.forward(tokens))[:, PROMPT_LEN - 1:]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_longrope_short_and_long(hf):
  path, refs = hf["phi3_longrope"]
  model = models.load(path)
  rope = model.config.rope
  assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 16
  assert rope.factor == 256 / 16
  assert math.isclose(rope.attention_factor, math.sqrt(1 + math.log(16) / math.log(16)))
  for n in LONGROPE_SWITCH:  # short factors, then long
    tokens = _tokens(1, n, seed=n)
    assert tiny.rel_error(model.forward(tokens), refs[f"switch_{n}"]) <= 1e-4
  tokens = _tokens(1, 20)
  short_prefix = np.asarray(model.forward(tokens[:, :16]))
  long_prefix = np.asarray(model.forward(tokens))[:, :16]
  assert tiny.rel_error(long_prefix, short_prefix) > 1e-2  # the switch changes every position
  # A run that stays within 16 positions keeps the short factors, as transformers' generate.
  prompt = _tokens(1, PROMPT_LEN)
  out = decode.generate(model, prompt[0].tolist(), 7, methods.make("dense", block_size=4),
                        stop_at_eos=False, prefill_chunk=4, capacity=16)
  assert out.tokens[0] == refs["greedy_short"]


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_checkpoint_loads(hf, name):
  path, refs = hf[f"{name}@40KB"]
  assert (pathlib.Path(path) / "model.safetensors.index.json").exists()
  assert len(list(pathlib.Path(path).glob("model-*.safetensors"))) > 1
  tokens = _tokens(1, 20)
  assert tiny.rel_error(models.load(path).forward(tokens), refs["f32_20"]) <= 1e-4
