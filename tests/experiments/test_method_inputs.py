"""What a run gives a method before the prompt (``sparse_attn.layer_inputs``) reaches it.

On the tiny random model, through the harness's own paths: FINCH's question length (the
accuracy protocol's split, ``decoding.prefill_all``: the shared compression prefill), CriticalKV's
W^O (the model's ``o_proj``, ``models.decode.prefill``) and Q-Filters' calibration table
(``specs.build(model=...)``, cached once on disk). Each wired value is in the layer states and
keeps other tokens than the method's fallback.
"""

import numpy as np
import pytest

from experiments.common import calibration, modelzoo, specs
from experiments.tasks import accuracy, decoding
from models import decode, steps
from sparse_attn.compression import criticalkv

B, S, CAP = 2, 96, 128


@pytest.fixture(scope="module")
def model():
  return modelzoo.tiny_random()


def _prompts():
  rng = np.random.default_rng(0)
  lengths = np.array([S, S - 20], np.int32)
  prompts = rng.integers(10, 5000, size=(B, S)).astype(np.int32)
  return np.where(np.arange(S) < lengths[:, None], prompts, 0), lengths


def _kept(caches):
  """Per layer, the kept positions of every (row, kv head), as a comparable array."""
  return [np.where(np.asarray(c.valid), np.asarray(c.pos), -1) for c in caches]


def _differs(a, b):
  return any(x.shape != y.shape or not np.array_equal(np.sort(x, -1), np.sort(y, -1))
             for x, y in zip(a, b))


def test_finch_observes_the_protocols_question(model):
  """The query-aware split's question length reaches every layer of FINCH (through the shared
  compression prefill) and changes what it keeps; query-agnostic prompts have no question."""
  prompts, lengths = _prompts()
  split = [(list(range(n)), n - q) for n, q in zip(lengths, (12, 30))]
  question = accuracy.query_length("query_aware", split)
  np.testing.assert_array_equal(question, [12, 30])
  assert accuracy.query_length("query_agnostic", split) is None
  m = specs.build("finch", 0.5, model=model)
  (_, asked), = decoding.prefill_all(model, prompts, lengths, [m], CAP,
                                     question_length=question)
  (_, blind), = decoding.prefill_all(model, prompts, lengths, [m], CAP)
  for state in asked.states:
    np.testing.assert_array_equal(np.asarray(state["question"]), question)
  assert all(np.all(np.asarray(s["question"]) == m.window_size) for s in blind.states)
  assert _differs(_kept(asked.caches), _kept(blind.caches))


def test_criticalkv_reads_each_layers_out_proj(model, monkeypatch):
  """``init_caches`` (as ``decode.prefill`` calls it) puts each layer's ``o_proj`` in
  CriticalKV's state; the kept set differs from the identity fallback (``||v||_1``)."""
  prompts, lengths = _prompts()
  m = specs.build("criticalkv:window_size=16", 0.5, model=model)  # not all window
  _, states = steps.init_caches(model.config, m, B, CAP, model.decode_params)
  for layer, state in zip(model.decode_params["layers"], states):
    wo = np.asarray(layer["o_proj"]["kernel"]).reshape(model.config.num_heads, -1,
                                                        model.config.hidden_size)
    np.testing.assert_allclose(np.asarray(state["out_proj"]), wo)  # one per layer, no batch
  *_, caches, states = decode.prefill(model, prompts, lengths, m, CAP)
  assert "out_proj" not in states[0]  # prefill-only: dropped once the prompt is compressed
  monkeypatch.setattr(criticalkv.CriticalKV, "layer_state", lambda self, s, i, x=None: s)
  *_, fallback, _ = decode.prefill(model, prompts, lengths, m, CAP)
  assert _differs(_kept(caches), _kept(fallback))


def test_qfilters_gets_the_models_calibration_once(model, tmp_path, monkeypatch):
  """``specs.build(model=...)`` gives Q-Filters the model's filter table, computed once and
  then read from ``$SPARSE_ATTN_CACHE``; its kept set differs from the explicit prompt
  fallback (``calibration=prompt``), which stays uncalibrated."""
  monkeypatch.setenv("SPARSE_ATTN_CACHE", str(tmp_path))
  calls, full = [], calibration.qfilters  # 512 tokens of the text, not 4,096: a faster test
  monkeypatch.setattr(calibration, "qfilters", _counting(
      lambda mdl: full(mdl, length=512, samples=500), calls))
  m = specs.build("qfilters", 0.5, model=model)
  again = specs.build("qfilters", 0.25, model=model)
  assert len(calls) == 2 and len(list(tmp_path.rglob("qfilters-*.npz"))) == 1
  table = np.load(next(tmp_path.rglob("qfilters-*.npz")))["filters"]
  np.testing.assert_array_equal(np.asarray(m.filters, np.float32), table)
  assert m.source == again.source == "text"
  prompt = specs.build("qfilters:calibration=prompt", 0.5, model=model)
  assert prompt.source == "prompt" and prompt.filters is None
  prompts, lengths = _prompts()
  *_, caches, states = decode.prefill(model, prompts, lengths, m, CAP)
  np.testing.assert_allclose(np.asarray(states[1]["filter"][0]), table[1])
  *_, fallback, _ = decode.prefill(model, prompts, lengths, prompt, CAP)
  assert _differs(_kept(caches), _kept(fallback))


def _counting(fn, calls):
  def wrapped(*args, **kwargs):
    calls.append(args)
    return fn(*args, **kwargs)
  return wrapped


def test_calibration_cache_tells_two_checkpoints_of_one_config_apart(tmp_path, monkeypatch):
  """Two random seeds of one config are two cache entries (the key samples the weights)."""
  monkeypatch.setenv("SPARSE_ATTN_CACHE", str(tmp_path))
  one, two = modelzoo.tiny_random(0), modelzoo.tiny_random(1)
  assert calibration._cache_path(one, "q", "t", 1, 1) != calibration._cache_path(two, "q", "t",
                                                                                  1, 1)
