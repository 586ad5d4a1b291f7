"""RESA / rectification / retro composed with a selector, end to end through the decode loop."""

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


def test_all_enhancers_with_full_selection_equal_dense(model):
  """Through every layer: full selection + RESA + rect + retro == dense."""
  m = methods.make("quest+resa+rect:f=3+retro:w=3", budget=1.0, block_size=8)
  tokens = _tokens(2, 30)
  tf = decode.teacher_forced(model, tokens, 14, m)
  np.testing.assert_allclose(tf, np.asarray(model.forward(tokens))[:, 13:], rtol=2e-4, atol=2e-4)


def test_sparse_compositions_generate(model):
  prompt = _tokens(1, 40, seed=1)[0].tolist()
  kw = dict(budget=0.25, block_size=8, n_sink=2, local_window=8)
  base = decode.generate(model, prompt, 8, methods.make("quest", **kw), stop_at_eos=False)
  rect = decode.generate(model, prompt, 8, methods.make("quest+rect:f=3", **kw),
                         stop_at_eos=False)
  # Rectification only rewrites the cache for later steps: tokens up to it are the selector's.
  assert rect.tokens[0][:4] == base.tokens[0][:4]
  full = decode.generate(model, prompt, 8, methods.make("quest+resa+rect:f=3+retro:w=3", **kw),
                         stop_at_eos=False)
  assert len(full.tokens[0]) == 8 and all(0 <= t < CFG.vocab_size for t in full.tokens[0])
