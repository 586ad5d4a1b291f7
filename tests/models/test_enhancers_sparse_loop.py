"""Rectification and RetroAttention at a sparse budget, through the decode loop, layer by layer.

At full budget both enhancers are no-ops, so the loop tests there cannot see whether the loop
rewrites the right K/V. Here the budget really drops blocks, and the caches the loop leaves
behind (captured from its jitted steps) are checked against a dense run:

* ReSA rectification (Sun et al. 2025, Sec. 2.2): every ``f`` steps the last ``f`` tokens are
  re-encoded densely, so their K/V equal a dense forward's in every layer; tokens decoded after
  the last rectification keep their sparse K/V (different from dense beyond layer 0, whose K/V
  depend only on the token and its position).
* RetroAttention (Choi et al. 2025, Sec. 3.2, KV re-embedding): a past query's output is updated
  while it is in the window, so its K/V in layers after the first are rewritten step after step;
  once it leaves the window they stay at the last value written for it.
"""

import jax
import numpy as np
import pytest

import models
from models import decode, llama, steps
from models.config import ModelConfig, RopeConfig
from sparse_attn import methods

CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=96, num_layers=3,
                  num_heads=6, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=1000.0),
                  tie_word_embeddings=False, qkv_bias=True)
# A budget that chooses 2 of the ~8 blocks by score, plus one local block on top.
SPARSE = dict(budget=0.15, block_size=8, n_sink=0, local_window=8)
PREFILL, TOTAL = 48, 62


@pytest.fixture(scope="module")
def model():
  params = llama.init_params(CFG, jax.random.key(3))
  return models.Model(CFG, params, None, "tiny")


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(5).integers(0, CFG.vocab_size, (2, TOTAL)).astype(np.int32)


class StepSpy:
  """Wraps the loop's jitted steps; keeps host copies of the caches after every step.

  ``snapshots[i]`` is ``(kind, newest position per row, [(k, v) per layer])``; copies are taken
  at once because the next step donates the buffers.
  """

  def __init__(self, monkeypatch):
    self.snapshots = []
    for name in ("decode_step", "rectify_step"):
      monkeypatch.setattr(steps, name, self._wrap(name, getattr(steps, name)))

  def _wrap(self, kind, fn):
    def step(params, history, positions, caches, states, *args, **kw):
      res = fn(params, history, positions, caches, states, *args, **kw)
      out_caches = res[-2]
      kv = [(np.asarray(c.k), np.asarray(c.v)) for c in out_caches]
      self.snapshots.append((kind, np.asarray(positions)[:, -1], kv))
      return res
    return step

  def final(self):
    return self.snapshots[-1][2]


def _dense_kv(model, tokens):
  """Per-layer ``(k, v) [B, K, T, D]`` of a dense run (equal to a dense forward's K/V)."""
  spy = pytest.MonkeyPatch()
  try:
    s = StepSpy(spy)
    decode.teacher_forced(model, tokens, PREFILL, methods.make("dense", block_size=8))
    return s.final()
  finally:
    spy.undo()


def _max_diff(a, b, positions):
  return float(np.max(np.abs(a[:, :, positions] - b[:, :, positions])))


def test_rectified_positions_equal_dense_kv_in_every_layer(model, tokens, monkeypatch):
  f = 4
  dense = _dense_kv(model, tokens)
  spy = StepSpy(monkeypatch)
  decode.teacher_forced(model, tokens, PREFILL, methods.make(f"quest+rect:f={f}", **SPARSE))
  assert [k for k, _, _ in spy.snapshots].count("rectify_step") == (TOTAL - PREFILL) // f
  steps = TOTAL - PREFILL
  rectified = np.arange(PREFILL, PREFILL + steps // f * f)
  trailing = np.arange(PREFILL + steps // f * f, TOTAL)
  assert len(trailing) > 0
  prompt = np.arange(PREFILL)
  for layer, ((k, v), (dk, dv)) in enumerate(zip(spy.final(), dense)):
    for got, want in ((k, dk), (v, dv)):
      np.testing.assert_allclose(got[:, :, prompt], want[:, :, prompt], atol=1e-5)
      np.testing.assert_allclose(got[:, :, rectified], want[:, :, rectified], atol=1e-4,
                                 err_msg=f"layer {layer}: rectified K/V differ from dense")
      if layer == 0:  # layer-0 K/V never depend on attention
        np.testing.assert_allclose(got[:, :, trailing], want[:, :, trailing], atol=1e-5)
      else:
        assert _max_diff(got, want, trailing) > 1e-3, f"layer {layer}: sparse K/V equal dense"


def test_sparse_budget_without_rectification_differs_from_dense(model, tokens, monkeypatch):
  """The control: the same budget leaves decoded K/V of deeper layers away from dense."""
  dense = _dense_kv(model, tokens)
  spy = StepSpy(monkeypatch)
  decode.teacher_forced(model, tokens, PREFILL, methods.make("quest", **SPARSE))
  decoded = np.arange(PREFILL, TOTAL)
  for (k, _), (dk, _) in list(zip(spy.final(), dense))[1:]:
    assert _max_diff(k, dk, decoded) > 1e-3


def test_retro_re_embeds_window_kv_and_freezes_it_after(model, tokens, monkeypatch):
  w = 3
  spy = StepSpy(monkeypatch)
  decode.teacher_forced(model, tokens, PREFILL, methods.make(f"quest+retro:w={w}", **SPARSE))
  snaps = [(int(t[0]), kv) for kind, t, kv in spy.snapshots if kind == "decode_step"]
  assert [t for t, _ in snaps] == list(range(PREFILL, TOTAL))
  by_step = dict(snaps)
  changed = 0
  for t, kv in snaps[1:]:
    prev = by_step[t - 1]
    for layer, ((k, v), (pk, pv)) in enumerate(zip(kv, prev)):
      # Positions that left the window (and the prompt) keep their K/V exactly.
      gone = np.arange(0, t - w + 1)
      np.testing.assert_array_equal(k[:, :, gone], pk[:, :, gone])
      np.testing.assert_array_equal(v[:, :, gone], pv[:, :, gone])
      stay = np.arange(t - w + 1, t)  # in the window at this step and the previous one
      stay = stay[stay >= PREFILL]
      if layer == 0:  # layer-0 K/V depend on the token and position only
        np.testing.assert_allclose(k[:, :, stay], pk[:, :, stay], atol=1e-6)
      elif len(stay) and _max_diff(k, pk, stay) > 1e-5:
        changed += 1
  # Deeper layers re-embed the window's past tokens at (almost) every step.
  assert changed >= (len(snaps) - 1) * (CFG.num_layers - 1) // 2, changed
  # Frozen after leaving: the final K/V of a position equal those of its last window step.
  final = snaps[-1][1]
  for p in range(PREFILL, TOTAL - w + 1):
    last = by_step[p + w - 1]
    for (k, v), (lk, lv) in zip(final, last):
      np.testing.assert_array_equal(k[:, :, p], lk[:, :, p])
      np.testing.assert_array_equal(v[:, :, p], lv[:, :, p])


def test_retro_re_embedding_moves_kv_away_from_the_selector_alone(model, tokens, monkeypatch):
  """Same budget with w=1 (the selector alone): the window re-embedding changes deeper K/V."""
  spy = StepSpy(monkeypatch)
  decode.teacher_forced(model, tokens, PREFILL, methods.make("quest+retro:w=3", **SPARSE))
  retro = spy.final()
  spy.snapshots.clear()
  decode.teacher_forced(model, tokens, PREFILL, methods.make("quest", **SPARSE))
  alone = spy.final()
  decoded = np.arange(PREFILL, TOTAL)
  np.testing.assert_allclose(retro[0][0][:, :, decoded], alone[0][0][:, :, decoded], atol=1e-5)
  for layer in range(1, CFG.num_layers):
    assert _max_diff(retro[layer][0], alone[layer][0], decoded) > 1e-4, layer
