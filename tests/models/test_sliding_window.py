"""Mistral's sliding window in generate / teacher_forced: parity with transformers.

The tiny random Mistral (``tiny.CONFIGS["mistral_window"]``) attends a window of 8 tokens;
prompts are longer than the window and the prompt is prefilled in several chunks, so prefill
chunks, decode steps and the cache all cross the window's edge.
"""

import jax
import numpy as np
import pytest

import models
from models import decode
from sparse_attn import methods
from tests.models import tiny

WINDOW = 8
PROMPT_LEN = 13  # > WINDOW
KW = dict(prefill_chunk=4, capacity=32)


def _tokens(b, n, seed=3):
  return np.random.default_rng(seed).integers(0, tiny.BASE["vocab_size"], (b, n))


NEW = 12  # greedy tokens


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
  """``(references, model)``: transformers' logits and greedy tokens computed in the child
  that saves the checkpoint (``tiny.references``)."""
  path = tmp_path_factory.mktemp("mistral")
  (refs,) = tiny.references([("mistral_window", path, {
      "f32_26": tiny.logits(_tokens(2, 26)),
      "greedy": tiny.greedy(_tokens(1, PROMPT_LEN), NEW)}, {})])
  model = models.load(str(path))
  assert model.config.sliding_window == WINDOW
  return refs, model


def test_teacher_forced_matches_transformers(mistral):
  refs, model = mistral
  tokens = _tokens(2, 26)
  ref = refs["f32_26"]
  ours = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                               **KW)
  assert tiny.rel_error(ours, ref[:, PROMPT_LEN - 1:]) <= 1e-4


def test_greedy_generate_matches_transformers(mistral):
  refs, model = mistral
  prompt = _tokens(1, PROMPT_LEN)
  new = NEW
  want = refs["greedy"]
  out = decode.generate(model, prompt[0].tolist(), new, methods.make("dense", block_size=4),
                        stop_at_eos=False, **KW)
  assert out.tokens[0] == want


def test_full_budget_selectors_equal_dense_under_window(mistral):
  _, model = mistral
  tokens = _tokens(1, 26, seed=5)
  dense = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                                **KW)
  for spec in ("quest", "topk", "arkvale"):
    m = methods.make(spec, budget=1.0, block_size=4)
    got = decode.teacher_forced(model, tokens, PROMPT_LEN, m, **KW)
    np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-4, err_msg=spec)


def test_methods_without_window_mask_are_refused(mistral):
  _, model = mistral
  with pytest.raises(NotImplementedError, match="sliding-window"):
    decode.generate(model, _tokens(1, PROMPT_LEN)[0].tolist(), 4,
                    methods.make("quest+resa", block_size=4), **KW)
  with pytest.raises(NotImplementedError, match="sliding-window"):
    decode.generate(model, _tokens(1, PROMPT_LEN)[0].tolist(), 4,
                    methods.make("expected_attention", ratio=0.5), **KW)
  with pytest.raises(ValueError, match="sliding window of 8"):  # prefill alone does not add it
    decode.prefill(model, _tokens(1, PROMPT_LEN), np.array([PROMPT_LEN]),
                   methods.make("dense", block_size=4), 32)


def test_compression_attends_and_scores_under_the_window(mistral):
  """A compression method on a windowed model attends under the window: at ratio 0 it equals
  dense; evicting half the prompt it runs (its windowed votes: ``test_compression_observe``)."""
  _, model = mistral
  tokens = _tokens(1, 26, seed=5)
  dense = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("dense", block_size=4),
                                **KW)
  got = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("snapkv", ratio=0.0), **KW)
  np.testing.assert_allclose(got, dense, rtol=1e-4, atol=1e-4)
  half = decode.teacher_forced(model, tokens, PROMPT_LEN, methods.make("snapkv", ratio=0.5),
                               **KW)
  assert np.isfinite(half).all()
