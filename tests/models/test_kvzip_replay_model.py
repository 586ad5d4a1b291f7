"""KVzip end to end on the tiny random model: ``models.decode.prefill`` runs the replays
(``models.kvzip_replay``, one ``replay_step`` per chunk), and the kept cache holds ``K ceil((1 -
ratio) n)`` tokens per row and layer (layer-wide top-k) and differs from the no-replay
fallback (every score 0: the sinks and the earliest tokens)."""

import math

import numpy as np

from experiments.common import modelzoo
from models import decode, kvzip_replay, steps
from sparse_attn import methods

CAP, CHUNK, RATIO = 128, 48, 0.5


def _kept(caches):
  """Per layer ``[B, slots]``: each row's kept token positions (-1: empty), sorted."""
  return [np.sort(np.where(np.asarray(c.valid), np.asarray(c.pos), -1).reshape(
      c.pos.shape[0], -1), axis=-1) for c in caches]


def test_replay_runs_and_keeps_its_share(monkeypatch):
  model = modelzoo.tiny_random()
  lengths = np.array([96, 70], np.int32)
  prompts = np.random.default_rng(0).integers(10, 5000, size=(2, 96)).astype(np.int32)
  prompts = np.where(np.arange(96) < lengths[:, None], prompts, 0)
  m = methods.make(f"kvzip:chunk_size={CHUNK}", ratio=RATIO)
  calls, step = [], steps.replay_step
  monkeypatch.setattr(steps, "replay_step", lambda *a, **k: calls.append(1) or step(*a, **k))
  *_, caches, states = decode.prefill(model, prompts, lengths, m, CAP)
  assert len(calls) == 2  # ceil(96 / 48) chunks, rows side by side
  k = model.config.num_kv_heads
  want = [k * math.ceil((1 - RATIO) * n) for n in lengths]
  for kept in _kept(caches):
    np.testing.assert_array_equal((kept >= 0).sum(-1), want)
  monkeypatch.setattr(kvzip_replay, "replay", lambda model, p, l, c, s, method, config: (c, s))
  *_, fallback, _ = decode.prefill(model, prompts, lengths, m, CAP)
  for with_replay, without in zip(_kept(caches), _kept(fallback)):
    np.testing.assert_array_equal((without >= 0).sum(-1), want)  # same size, other tokens
    assert not np.array_equal(with_replay, without)
