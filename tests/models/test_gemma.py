"""Gemma 2 and Gemma 3 (text) against transformers, and every kind of method on them (issue 53).

The tiny random checkpoints (``tiny.CONFIGS["gemma2" | "gemma3_text"]``) have local layers with
a window of 8 tokens beside global ones (Gemma 2: local, global; Gemma 3: local, local, global
with its own RoPE base on the local layers and linear RoPE scaling on the global one), soft-caps
small enough to bend their logits (Gemma 2: attention 2.0 and final 1.5; Gemma 3: final 1.5),
and ``query_pre_attn_scalar`` != ``head_dim``. Prompts are longer than the window and prefilled
in several chunks, so prefill chunks, decode steps and the cache all cross the window's edge on
the local layers.
"""

import json

import numpy as np
import pytest

import models
from models import decode, llama
from models.config import ModelConfig
from sparse_attn import methods
from tests.models import tiny

PROMPT_LEN = 13  # > the window
KW = dict(prefill_chunk=4, capacity=32)


_tokens = tiny.random_tokens
TEACHER_FORCED = (16, 26)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """``name -> (path, references)``: both checkpoints and every transformers reference the
  tests compare with, computed in one child process (``tiny.references``)."""
  root = tmp_path_factory.mktemp("hf")
  specs = []
  for name in tiny.GEMMA_FAMILIES:
    requests = {"f32_24": tiny.logits(_tokens(2, 24)),
                "bf16_24": tiny.logits(_tokens(2, 24), "bfloat16"),
                "greedy": tiny.greedy(_tokens(1, PROMPT_LEN), 12)}
    for n in TEACHER_FORCED:
      requests[f"f32_{n}"] = tiny.logits(_tokens(2, n))
    specs.append((name, root / name, requests, {}))
  refs = tiny.references(specs)
  return {name: (str(root / name), r) for name, r in zip(tiny.GEMMA_FAMILIES, refs)}


@pytest.fixture(scope="module", params=tiny.GEMMA_FAMILIES)
def family(request, hf):
  """``(name, path, model, references)``."""
  path, refs = hf[request.param]
  return request.param, path, models.load(path), refs


def _dense():
  return methods.make("dense", block_size=4)


def test_config_reads_the_family(family):
  name, _, model, _ = family
  c = model.config
  assert c.norm_plus_one and c.sandwich_norms and c.scale_embeddings and c.tie_word_embeddings
  assert c.hidden_act == "gelu_pytorch_tanh" and c.softmax_scale == 0.5  # 4 ** -0.5
  assert c.sliding_window == tiny.GEMMA_WINDOW and c.per_layer_windows
  if name == "gemma2":
    assert c.sliding_layers == (True, False) and (c.attn_softcap, c.final_softcap) == (2.0, 1.5)
    assert not c.qk_norm and c.local_rope is None
  else:
    assert c.sliding_layers == (True, True, False) and c.qk_norm
    assert (c.attn_softcap, c.final_softcap) == (None, 1.5)
    assert (c.rope.rope_type, c.rope.factor, c.rope.theta) == ("linear", 2.0, 1e4)
    assert c.rope_of(True).theta == 100.0 and c.rope_of(False) == c.rope
  assert ModelConfig.from_hf_config(c.to_hf_config()) == c


def test_forward_matches_transformers_and_the_caps_matter(family):
  """float32 logits within 1e-4 relative; without its soft-caps (or with one RoPE base, or
  without windows) the model is measurably another one, so each is tested."""
  name, _, model, refs = family
  tokens = _tokens(2, 24)
  ref = refs["f32_24"]
  assert tiny.rel_error(model.forward(tokens), ref) <= 1e-4
  c = model.config
  variants = {"final_softcap": c.replace(final_softcap=None),
              "window": c.replace(sliding_window=None)}
  if name == "gemma2":
    variants["attn_softcap"] = c.replace(attn_softcap=None)
  else:
    variants["local_rope"] = c.replace(local_rope=None)
  for what, other in variants.items():
    got = np.asarray(llama.forward(model.params, other, np.asarray(tokens, np.int32)))
    assert tiny.rel_error(got, ref) > 1e-2, what


@pytest.mark.parametrize("n", TEACHER_FORCED)
def test_teacher_forced_matches_transformers(family, n):
  _, _, model, refs = family
  tokens = _tokens(2, n)
  ref = refs[f"f32_{n}"]
  got = decode.teacher_forced(model, tokens, PROMPT_LEN, _dense(), **KW)
  assert tiny.rel_error(got, ref[:, PROMPT_LEN - 1:]) <= 1e-4


def test_greedy_generate_matches_transformers(family):
  _, _, model, refs = family
  prompt = _tokens(1, PROMPT_LEN)
  want = refs["greedy"]
  out = decode.generate(model, prompt[0].tolist(), 12, _dense(), stop_at_eos=False, **KW)
  assert out.tokens[0] == want


def test_bfloat16_logits_close(family):
  """Within the other families' 3e-2, or within transformers' own bfloat16 error where that is
  larger (the tiny Gemma 3: 6.2e-2 for transformers, 4.1e-2 here, against its float32)."""
  _, path, _, refs = family
  model = models.load(path, dtype="bfloat16")
  tokens = _tokens(2, 24)
  got = np.asarray(model.forward(tokens))
  f32, bf16 = refs["f32_24"], refs["bf16_24"]
  bound = max(3e-2, tiny.rel_error(bf16, f32))
  assert tiny.rel_error(got, f32) <= bound
  assert tiny.rel_error(got, bf16) <= bound


def test_full_budget_methods_equal_dense(family):
  """A selector, an enhancer and a compression method at full budget equal dense: each local
  layer runs under its window (the selector ranks only blocks inside it, SnapKV's attention
  and votes are windowed), every layer soft-capped (Gemma 2)."""
  name, _, model, _ = family
  tokens = _tokens(1, 26, seed=5)
  run = lambda m: decode.teacher_forced(model, tokens, PROMPT_LEN, m, **KW)
  dense = run(_dense())
  specs = {"quest": dict(budget=1.0, block_size=4),
           "quest+rect": dict(budget=1.0, block_size=4, f=4),
           "snapkv": dict(ratio=0.0)}
  for spec, options in specs.items():
    np.testing.assert_allclose(run(methods.make(spec, **options)), dense, rtol=1e-4,
                               atol=1e-4, err_msg=f"{name} {spec}")


def test_the_fused_decode_layout_equals_forward(family):
  """The GPU decode layout (q/k/v, gate/up fused) keeps the four norms and the q/k norms."""
  _, _, model, _ = family
  fused = models.Model(model.config, llama.decode_layout(model.params, fuse=True), None)
  tokens = _tokens(1, 20)
  got = decode.teacher_forced(fused, tokens, PROMPT_LEN, _dense(), prefill_chunk=4)
  want = np.asarray(model.forward(tokens))[:, PROMPT_LEN - 1:]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_methods_that_cannot_follow_are_refused(family):
  """RESA and retro have no window mask (the local layers refuse them); RESA, the adaptive
  rules and Expected Attention do not model a soft-cap (Gemma 2 refuses them on every layer)."""
  name, _, model, _ = family
  prompt = _tokens(1, PROMPT_LEN)[0].tolist()
  refused = ["quest+resa", "quest+retro:w=2"]
  if name == "gemma2":
    refused += ["quest:topp=0.9", "expected_attention"]
  for spec in refused:
    with pytest.raises(NotImplementedError, match="sliding-window|soft-caps"):
      decode.generate(model, prompt, 4, methods.make(spec, block_size=4), **KW)


def test_within_the_window_every_layer_is_global(family):
  """A run whose cache never outgrows the window asks no method for a window: retro runs (its
  window partials soft-capped on Gemma 2) and RESA runs on Gemma 3 (no soft-cap), both equal
  to dense at full budget."""
  name, _, model, _ = family
  tokens = _tokens(1, tiny.GEMMA_WINDOW, seed=7)
  kw = dict(prefill_chunk=4, capacity=tiny.GEMMA_WINDOW)
  dense = decode.teacher_forced(model, tokens, 4, _dense(), **kw)
  retro = methods.make("quest+retro:w=2", budget=1.0, block_size=4)
  np.testing.assert_allclose(decode.teacher_forced(model, tokens, 4, retro, **kw), dense,
                             rtol=1e-4, atol=1e-4)
  resa = methods.make("quest+resa", budget=1.0, block_size=4)
  if name == "gemma2":
    with pytest.raises(NotImplementedError, match="soft-caps"):
      decode.teacher_forced(model, tokens, 4, resa, **kw)
  else:
    np.testing.assert_allclose(decode.teacher_forced(model, tokens, 4, resa, **kw), dense,
                               rtol=1e-4, atol=1e-4)


GEMMA3_OLD = dict(  # a transformers 4.x gemma3_text config.json (gemma-3-1b style keys)
    model_type="gemma3_text", vocab_size=97, hidden_size=64, intermediate_size=112,
    num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, rope_theta=1e6,
    rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=8.0),
    sliding_window=512, sliding_window_pattern=6, attn_logit_softcapping=None,
    final_logit_softcapping=None, cache_implementation="hybrid", rms_norm_eps=1e-6)


def test_older_config_keys_and_refusals():
  c = ModelConfig.from_hf_config(GEMMA3_OLD)
  assert c.sliding_layers == (True,) * 5 + (False,) and c.tie_word_embeddings
  assert (c.rope.theta, c.rope.rope_type, c.rope.factor) == (1e6, "linear", 8.0)
  assert c.rope_of(True).theta == 1e4 and c.rope_of(True).rope_type == "default"
  g2 = dict(GEMMA3_OLD, model_type="gemma2", num_hidden_layers=3)
  for k in ("rope_local_base_freq", "rope_scaling", "sliding_window_pattern",
            "attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's defaults
    del g2[k]
  c2 = ModelConfig.from_hf_config(g2)
  assert c2.sliding_layers == (True, False, True) and c2.attn_softcap == 50.0
  assert c2.final_softcap == 30.0 and c2.local_rope is None
  for bad, match in ((dict(use_bidirectional_attention=True), "bidirectional"),
                     (dict(attn_logit_softcapping=50.0), "Gemma3Attention does not apply"),
                     (dict(hidden_activation="gelu"), "hidden_activation"),
                     (dict(layer_types=["chunked_attention"] * 6), "layer_types")):
    with pytest.raises(ValueError, match=match):
      ModelConfig.from_hf_config({**GEMMA3_OLD, **bad})
  with pytest.raises(ValueError, match="query_pre_attn_scalar"):  # a Gemma key on Llama
    ModelConfig.from_hf_config({**json.loads(json.dumps(g2)), "model_type": "llama"})
