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

import numpy as np
import pytest

import models
from models import decode, llama
from sparse_attn import methods
from tests.models import tiny

PROMPT_LEN = 9
KW = dict(prefill_chunk=4, capacity=32)


@pytest.fixture(scope="module", params=tiny.NEW_FAMILIES)
def family(request, tmp_path_factory):
  return tiny.loaded(request.param, tmp_path_factory)


_tokens = tiny.random_tokens


def test_greedy_generate_matches_transformers(family):
  """A prompt past phi3_window's window and phi3_longrope's original length (17 > 16: the
  long factors throughout, in transformers and in a run of this capacity)."""
  _, path, model = family
  prompt = _tokens(1, tiny.LONGROPE_ORIGINAL + 1)
  want = tiny.hf_greedy(path, prompt, 8)
  out = decode.generate(model, prompt[0].tolist(), 8, methods.make("dense", block_size=4),
                        stop_at_eos=False, **KW)
  assert out.tokens[0] == want


@pytest.mark.parametrize("n", [tiny.LONGROPE_ORIGINAL, 26])
def test_teacher_forced_matches_transformers(family, n):
  """A cache of 16 positions (LongRoPE's short factors) and of 28 (the long ones), as
  transformers' forward over 16 and 26 tokens."""
  _, path, model = family
  tokens = _tokens(2, n)
  ref = tiny.hf_logits(path, tokens)
  got = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                              prefill_chunk=4)
  assert tiny.rel_error(got, ref[:, PROMPT_LEN - 1:]) <= 1e-4


def test_bfloat16_logits_close(family):
  _, path, _ = family
  model = models.load(path, dtype="bfloat16")
  tokens = _tokens(2, 24)
  got = np.asarray(model.forward(tokens))
  assert tiny.rel_error(got, tiny.hf_logits(path, tokens)) <= 3e-2
  assert tiny.rel_error(got, tiny.hf_logits(path, tokens, "bfloat16")) <= 3e-2


def test_full_budget_methods_equal_dense(family):
  name, _, model = family
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
  _, _, model = family
  fused = models.Model(model.config, llama.decode_layout(model.params, fuse=True), None)
  assert llama.is_fused(fused.params["layers"])
  tokens = _tokens(1, 20)
  got = decode.teacher_forced(fused, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                              prefill_chunk=4)
  want = np.asarray(model.forward(tokens))[:, PROMPT_LEN - 1:]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_longrope_short_and_long(tmp_path):
  path = tiny.make_hf("phi3_longrope", tmp_path)
  model = models.load(path)
  rope = model.config.rope
  assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 16
  assert rope.factor == 256 / 16
  assert math.isclose(rope.attention_factor, math.sqrt(1 + math.log(16) / math.log(16)))
  for n in (tiny.LONGROPE_ORIGINAL, tiny.LONGROPE_ORIGINAL + 1):  # short factors, then long
    tokens = _tokens(1, n, seed=n)
    assert tiny.rel_error(model.forward(tokens), tiny.hf_logits(path, tokens)) <= 1e-4
  tokens = _tokens(1, 20)
  short_prefix = np.asarray(model.forward(tokens[:, :16]))
  long_prefix = np.asarray(model.forward(tokens))[:, :16]
  assert tiny.rel_error(long_prefix, short_prefix) > 1e-2  # the switch changes every position
  # A run that stays within 16 positions keeps the short factors, as transformers' generate.
  prompt = _tokens(1, PROMPT_LEN)
  out = decode.generate(model, prompt[0].tolist(), 7, methods.make("dense", block_size=4),
                        stop_at_eos=False, prefill_chunk=4, capacity=16)
  assert out.tokens[0] == tiny.hf_greedy(path, prompt, 7)


@pytest.mark.parametrize("name", ["phi3_window", "gemma3_text"])
def test_sharded_checkpoint_loads(tmp_path, name):
  path = tiny.make_hf(name, tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  tokens = _tokens(1, 20)
  assert tiny.rel_error(models.load(path).forward(tokens), tiny.hf_logits(path, tokens)) <= 1e-4
