"""KVzip end to end on the tiny random model: ``models.decode.prefill`` runs the replays
(``models.kvzip_replay``, one ``replay_step`` per chunk), then keeps the model's top ``ceil((1 -
ratio) L K n)`` replay scores over all layers and heads at once (the default, the authors' and
kvpress's; numpy ranks the scores captured before ``end_prefill``), or ``K ceil((1 - ratio) n)``
per layer (``layerwise=True``); and the kept cache differs from the no-replay fallback (every
score 0: the sinks and the earliest tokens)."""

import math

import numpy as np
import pytest

from experiments.common import modelzoo
from models import decode, kvzip_replay, steps
from sparse_attn import methods

CAP, CHUNK, RATIO, SINK = 128, 48, 0.5, 4
LENGTHS = np.array([96, 70], np.int32)


def _kept(caches):
  """Per layer ``[B, slots]``: each row's kept token positions (-1: empty), sorted."""
  return [np.sort(np.where(np.asarray(c.valid), np.asarray(c.pos), -1).reshape(
      c.pos.shape[0], -1), axis=-1) for c in caches]


def _pairs(cache, b):
  """Row ``b``'s kept ``(kv head, position)`` pairs of a flat cache, as a set."""
  ok = np.asarray(cache.pos[b]) >= 0
  return set(zip(np.asarray(cache.head[b])[ok].tolist(), np.asarray(cache.pos[b])[ok].tolist()))


def _prompts():
  prompts = np.random.default_rng(0).integers(10, 5000, size=(2, 96)).astype(np.int32)
  return np.where(np.arange(96) < LENGTHS[:, None], prompts, 0)


def _prefill(model, m, monkeypatch):
  """``(caches after end_prefill, states before it)`` of ``decode.prefill``."""
  seen, end = [], decode.end_prefill
  monkeypatch.setattr(decode, "end_prefill",
                      lambda c, s, **kw: seen.append(s) or end(c, s, **kw))
  *_, caches, _ = decode.prefill(model, _prompts(), LENGTHS, m, CAP)
  monkeypatch.setattr(decode, "end_prefill", end)
  return caches, seen[0]


@pytest.mark.parametrize("layerwise", [False, True])
def test_replay_runs_and_keeps_its_share(monkeypatch, layerwise):
  model = modelzoo.tiny_random()
  m = methods.make(f"kvzip:chunk_size={CHUNK},layerwise={layerwise}", ratio=RATIO)
  calls, step = [], steps.replay_step
  monkeypatch.setattr(steps, "replay_step", lambda *a, **k: calls.append(1) or step(*a, **k))
  caches, states = _prefill(model, m, monkeypatch)
  assert len(calls) == 2  # ceil(96 / 48) chunks, rows side by side
  k, layers = model.config.num_kv_heads, model.config.num_layers
  per_layer = [k * math.ceil((1 - RATIO) * n) for n in LENGTHS]
  counts = np.stack([(kept >= 0).sum(-1) for kept in _kept(caches)])  # [L, B]
  if layerwise:
    for c in counts:
      np.testing.assert_array_equal(c, per_layer)
  else:  # numpy: one ranking of every (layer, head, position), sinks first, stable ties
    np.testing.assert_array_equal(counts.sum(0), [math.ceil((1 - RATIO) * layers * k * n)
                                                  for n in LENGTHS])
    assert len(set(counts[:, 0])) > 1  # the layers' shares differ
    for b, n in enumerate(LENGTHS):
      score = np.stack([np.asarray(s["score"])[b, :, :n] for s in states])  # [L, K, n]
      score = np.where(np.arange(n) < SINK, np.inf, score)
      top = np.argsort(-score.reshape(-1), kind="stable")[:math.ceil((1 - RATIO) * score.size)]
      layer, head, pos = np.unravel_index(top, score.shape)
      for i, cache in enumerate(caches):
        want = set(zip(head[layer == i].tolist(), pos[layer == i].tolist()))
        assert _pairs(cache, b) == want, (i, b)
  monkeypatch.setattr(kvzip_replay, "replay", lambda model, p, l, c, s, method, config: (c, s))
  *_, fallback, _ = decode.prefill(model, _prompts(), LENGTHS, m, CAP)
  for with_replay, without in zip(_kept(caches), _kept(fallback)):
    assert not np.array_equal(with_replay, without)


def test_kvzip_plus_gets_each_layers_out_proj_and_the_replay_norms(monkeypatch):
  """KVzip+ in a model run: each layer's state holds that layer's ``W^O`` while the replays run
  (dropped at ``end_prefill``), and layer 0's replay is handed ``||x_s||`` of its attention
  input (numpy: the replay tokens' embeddings through layer 0's input RMSNorm); the kept cache
  differs from KVzip's."""
  from models import llama  # pylint: disable=g-import-not-at-top
  from sparse_attn.compression import kvzip  # pylint: disable=g-import-not-at-top
  model = modelzoo.tiny_random(random_norms=True)  # attention-input norms differ by token
  m = methods.make(f"kvzip:chunk_size={CHUNK},plus=true", ratio=RATIO)
  seen, record = [], kvzip.KVzip.record_replay
  monkeypatch.setattr(kvzip.KVzip, "record_replay", lambda self, q, k, cache, state, pos, **kw: (
      seen.append((q.shape, state.get("out_proj"), kw["hidden_norm"], pos)) or
      record(self, q, k, cache, state, pos, **kw)))
  monkeypatch.setattr(steps, "_layer", steps._layer_body)  # eager: each layer's own values
  caches, states = _prefill(model, m, monkeypatch)
  layers = llama.split_layers(model.decode_params)["layers"]
  assert len(seen) == 2 * len(layers)  # two chunks x every layer
  for i, (qshape, wo, norm, _) in enumerate(seen[:len(layers)]):
    np.testing.assert_array_equal(wo, layers[i]["o_proj"]["kernel"])
    assert norm.shape == (qshape[0], qshape[2])
  assert all("out_proj" in s for s in states)  # held while the replays ran
  rows = kvzip_replay.replay_tokens(model.tokenizer, _prompts()[0, :LENGTHS[0]], CHUNK)
  ids = np.asarray(rows[0][2])
  x = np.asarray(model.decode_params["embed"], np.float64)[ids]
  scale = np.asarray(layers[0]["attn_norm"]["scale"], np.float64)
  h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + model.config.rms_norm_eps) * scale
  np.testing.assert_allclose(np.asarray(seen[0][2])[0, :len(ids)], np.linalg.norm(h, axis=-1),
                             rtol=1e-5)
  plain, _ = _prefill(model, methods.make(f"kvzip:chunk_size={CHUNK}", ratio=RATIO),
                      monkeypatch)
  assert any(not np.array_equal(a, b) for a, b in zip(_kept(caches), _kept(plain)))
