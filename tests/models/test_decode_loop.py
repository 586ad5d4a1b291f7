"""The decode loop: dense teacher forcing == full forward, padding, methods, schedule hooks."""

import dataclasses

import jax
import numpy as np
import pytest

import models
from models import decode, llama
from models.config import ModelConfig, RopeConfig
from sparse_attn import methods

CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=1000.0),
                  tie_word_embeddings=False, qkv_bias=True)

@pytest.fixture(scope="module")
def model():
  return models.Model(CFG, llama.init_params(CFG, jax.random.key(0)), None, "tiny")

def _tokens(b, n, seed=0):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, n)).astype(np.int32)

def test_dense_teacher_forced_equals_forward(model):
  tokens = _tokens(2, 40)
  full = np.asarray(model.forward(tokens))
  # chunk 16 -> three prompt chunks, the last one partly padding
  tf = decode.teacher_forced(model, tokens, 21, methods.make("dense"), prefill_chunk=16)
  assert tf.shape == (2, 40 - 21 + 1, CFG.vocab_size)
  np.testing.assert_allclose(tf, full[:, 20:], rtol=1e-4, atol=1e-4)

def test_batch_with_padding_equals_batch_one(model):
  prompts = [_tokens(1, n, seed=n)[0].tolist() for n in (5, 19, 12)]
  method = methods.make("dense")
  kw = dict(prefill_chunk=8, capacity=64, stop_at_eos=False)
  batched = decode.generate(model, prompts, 10, method, **kw)
  for i, p in enumerate(prompts):
    single = decode.generate(model, p, 10, method, **kw)
    assert batched.tokens[i] == single.tokens[0]

def test_generate_greedy_matches_forward_argmax(model):
  prompt = _tokens(1, 9)[0].tolist()
  gen = decode.generate(model, prompt, 6, methods.make("dense"), stop_at_eos=False)
  seq = list(prompt)
  for _ in range(6):
    seq.append(int(np.argmax(np.asarray(model.forward(np.array([seq])))[0, -1])))
  assert gen.tokens[0] == seq[len(prompt):]
  assert gen.decode_steps == 5 and gen.decode_tokens_per_second > 0

@pytest.mark.parametrize("spec, kw", [("quest", dict(budget=0.25, block_size=8)),
                                      ("quest", dict(budget=1.0, block_size=8))])
def test_sparse_method_runs(model, spec, kw):
  prompt = _tokens(1, 40)[0].tolist()
  method = methods.make(spec, **kw)
  gen = decode.generate(model, prompt, 8, method, stop_at_eos=False)
  assert len(gen.tokens[0]) == 8
  if kw["budget"] == 1.0:  # a budget covering everything is dense
    dense = decode.generate(model, prompt, 8, methods.make("dense", block_size=8),
                            stop_at_eos=False)
    assert gen.tokens == dense.tokens

@dataclasses.dataclass(frozen=True)
class _Rectifying(methods.Method):
  """Dense attention that also asks for a dense rectification every 3 tokens."""

  calls: tuple = ()

  @property
  def rect_interval(self) -> int:
    return 3

def test_rectification_hook_keeps_dense_tokens(model):
  prompt = _tokens(1, 11)[0].tolist()
  base = decode.generate(model, prompt, 10, methods.make("dense"), stop_at_eos=False)
  rect = decode.generate(model, prompt, 10, _Rectifying(), stop_at_eos=False)
  assert rect.tokens == base.tokens
  tokens = _tokens(1, 30)
  tf = decode.teacher_forced(model, tokens, 12, _Rectifying())
  np.testing.assert_allclose(tf, np.asarray(model.forward(tokens))[:, 11:], rtol=1e-4,
                             atol=1e-4)

def test_sampling_seeded_and_top_p(model):
  prompt = _tokens(1, 7)[0].tolist()
  s = models.Sampling(temperature=1.0, top_p=0.9, seed=3)
  a = decode.generate(model, prompt, 8, methods.make("dense"), s, stop_at_eos=False)
  b = decode.generate(model, prompt, 8, methods.make("dense"), s, stop_at_eos=False)
  assert a.tokens == b.tokens
  tiny_p = models.Sampling(temperature=1.0, top_p=1e-6, seed=5)  # top-p -> greedy
  c = decode.generate(model, prompt, 8, methods.make("dense"), tiny_p, stop_at_eos=False)
  g = decode.generate(model, prompt, 8, methods.make("dense"), stop_at_eos=False)
  assert c.tokens == g.tokens

def test_stop_at_eos(model):
  prompt = _tokens(1, 7)[0].tolist()
  g = decode.generate(model, prompt, 8, methods.make("dense"), stop_at_eos=False)
  eos = g.tokens[0][2]
  m2 = models.Model(CFG.replace(eos_token_ids=(eos,)), model.params, None)
  cut = decode.generate(m2, prompt, 8, methods.make("dense"))
  assert cut.tokens[0] == g.tokens[0][:g.tokens[0].index(eos) + 1]

def test_window_positions():
  np.testing.assert_array_equal(decode.window_positions(np.array([1, 5]), 3),
                                [[-1, 0, 1], [3, 4, 5]])
