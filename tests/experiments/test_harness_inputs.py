"""Every harness builds its methods for the model, and FINCH's ring is sized for the question.

* The harnesses beside accuracy / generate (perplexity, long_generation, needle_keep,
  resa_lambda, ea_needle_diagnosis) build with ``model=`` (``specs.for_model``: RoPE and the
  calibration tables), so Q-Filters and DuoAttention run calibrated there too; perplexity's
  entries are checked (the calibration itself is stubbed: ``test_method_inputs`` runs it).
* ``specs.sized_for_question``: FINCH entries get a ring for the run's longest question, and
  the shared compression prefill then observes a 100-token question whole; an unsized FINCH
  refuses it (no cut to its last 64 tokens).
"""

import inspect

import numpy as np
import pytest
from ml_collections import config_dict

from experiments.analysis import ea_needle_diagnosis, needle_keep, resa_lambda
from experiments.common import calibration, modelzoo, specs
from experiments.tasks import decoding, long_generation, perplexity


@pytest.fixture(scope="module")
def model():
  return modelzoo.tiny_random()


def test_harnesses_build_for_the_model(model, monkeypatch):
  l, k = model.config.num_layers, model.config.num_kv_heads
  monkeypatch.setattr(calibration, "qfilters", lambda m: np.ones((l, k, model.config.head_dim)))
  monkeypatch.setattr(calibration, "duo_head_scores", lambda m, num_positions: np.ones((l, k)))
  c = config_dict.ConfigDict(dict(methods=("dense", "qfilters", "duo_attention_on_the_fly"), budgets=(0.5,),
                                  block_size=16, sweep_selector="quest", sweep_p=0.1,
                                  rect_fs=(), ps=()))
  rows = {e.label: e.method for _, e in perplexity._sweep_entries(c, model)}  # pylint: disable=protected-access
  assert rows["qfilters@0.5"].source == "text" and rows["qfilters@0.5"].filters is not None
  assert rows["duo_attention_on_the_fly@0.5"].table is not None
  for module in (perplexity, long_generation, needle_keep, resa_lambda, ea_needle_diagnosis):
    src = inspect.getsource(module)
    assert "rope_inv_freq=" not in src and "model=model" in src, module.__name__


def test_finch_observes_a_long_question_whole(model):
  b, s, question = 2, 160, np.array([100, 70], np.int32)
  prompts = np.random.default_rng(0).integers(10, 5000, size=(b, s)).astype(np.int32)
  lengths = np.array([s, s - 30], np.int32)
  entries = specs.expand(["finch", "snapkv"], [0.5], model=model)
  calls = []
  sized = specs.sized_for_question(entries, lambda: calls.append(1) or int(question.max()))
  assert [e.method.window_size for e in sized] == [128, 64] and calls == [1]
  assert specs.sized_for_question(entries[1:], lambda: calls.append(1) or 0) == entries[1:]
  assert calls == [1]  # no FINCH: the questions are not measured
  (_, pre), = decoding.prefill_all(model, prompts, lengths, [sized[0].method], 256,
                                   question_length=question)
  for state in pre.states:
    np.testing.assert_array_equal(state["question"], question)
    assert state["obs"]["buf"].shape[1] == 128
  with pytest.raises(ValueError, match="at most window_size=64 question tokens"):
    next(decoding.prefill_all(model, prompts, lengths, [entries[0].method], 256,
                              question_length=question))
