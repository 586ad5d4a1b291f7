"""A token press composed with ThinK (``"snapkv:ratio=0.5+think:ratio=0.5"``, kvpress's
``ComposedPress([SnapKVPress, ThinKPress])``) against brute force: the kept tokens are the
press's alone, the kept key channels are ThinK's Eq. 4 on those tokens (numpy), the cache
really holds ``D'`` channels of the kept tokens only, and decoding equals float64 attention
over the kept tokens with the pruned channels zeroed (plus the generated tokens whole)."""

import dataclasses

import jax
import numpy as np
import pytest

from sparse_attn import methods
from sparse_attn.compression import think
from sparse_attn.compression.think_composed import ThinKComposed
from sparse_attn.layer_inputs import LayerInputs
from tests.sparse_attn.test_compression_think import (B, D, HKV, HQ, LENGTHS, STEPS, T, W,
                                                      prefill, problem, run)

G = HQ // HKV
PRESSES = ["snapkv:window_size=8", "h2o", "knorm", "criticalkv:window_size=8",
           "finch:window_size=8,rerotate_keys=false"]


def _kept(cache):
  """``[B, K]`` sorted arrays of the token positions each kv head holds."""
  pos = np.asarray(cache.pos)
  return [[np.sort(pos[b, h][pos[b, h] >= 0]) for h in range(HKV)] for b in range(B)]


def _np_channels(p, kept, ratio):
  """``[B, K, D']``: Eq. 4 over the last ``W`` prompt queries and the kept keys only."""
  q, k = np.asarray(p["q"], np.float64), np.asarray(p["k"], np.float64)
  dk = D - int(D * ratio)
  out = np.zeros((B, HKV, dk), np.int64)
  for b, n in enumerate(LENGTHS):
    for h in range(HKV):
      qw = q[b, h * G:(h + 1) * G, n - W:n]
      s = (qw ** 2).mean(axis=(0, 1)) * (k[b, h, kept[b][h]] ** 2).mean(axis=0)
      out[b, h] = np.sort(np.argsort(-s, kind="stable")[:dk])
  return out


def _np_decode(p, kept, channels, recent=0):
  """float64 decode outputs: each step's query over the kept prompt tokens (pruned channels
  zeroed but in the last ``recent``, scale 1/sqrt(D)) and the generated tokens so far."""
  f = lambda x: np.asarray(x, np.float64)
  outs = np.zeros((STEPS, B, HQ, 1, D))
  for b in range(B):
    for hq in range(HQ):
      h = hq // G
      n = len(kept[b][h])
      mask = np.zeros((n, D))
      mask[:, channels[b, h]] = 1
      mask[max(n - recent, 0):] = 1
      keys, vals = [f(p["k"])[b, h, kept[b][h]] * mask], [f(p["v"])[b, h, kept[b][h]]]
      for i in range(STEPS):
        keys.append(f(p["dk"][i])[b, h, :1])
        vals.append(f(p["dv"][i])[b, h, :1])
        kk, vv = np.concatenate(keys), np.concatenate(vals)
        logit = kk @ f(p["dq"][i])[b, hq, 0] / np.sqrt(D)
        w = np.exp(logit - logit.max())
        outs[i, b, hq, 0] = w @ vv / w.sum()
  return list(outs)


def _end(m):
  """``m.end_prefill``; CriticalKV's reads W^O from the state: a fixed random one first."""
  if "critical" not in m.name:
    return m.end_prefill
  wo = np.random.default_rng(7).normal(size=(HQ * D, 12)) / np.sqrt(D)
  return lambda c, s: m.end_prefill(c, m.layer_state(s, 0, LayerInputs(out_proj=wo)))


@pytest.mark.parametrize("press", PRESSES)
def test_tokens_are_the_press_channels_are_thinks_output_is_dense_over_them(press):
  m = methods.make(f"{press}+think:ratio=0.5,window_size={W}", ratio=0.5)
  assert isinstance(m, ThinKComposed) and m.ratio == 0.5 and m.think.ratio == 0.5
  alone = methods.make(press, ratio=0.5)
  p = problem(11)
  _, solo = run(alone, p, end=_end(alone))
  outs, cache = run(m, p, end=_end(m))
  assert isinstance(cache, think.ThinKCache)
  kept = _kept(cache.prompt)
  want = _kept(solo)  # the press's tokens, alone (its decode appends after them)
  for b, n in enumerate(LENGTHS):
    for h in range(HKV):
      np.testing.assert_array_equal(kept[b][h], want[b][h][want[b][h] < n])
      assert len(kept[b][h]) == -(-n // 2)  # ceil((1 - r) L)
  channels = _np_channels(p, kept, 0.5)
  np.testing.assert_array_equal(cache.channels, channels)
  # real memory: D' key channels, only the kept slots (the longest row's) in the prompt part
  assert cache.prompt.k.shape == (B, HKV, -(-max(LENGTHS) // 2), D // 2)
  assert cache.prompt.v.shape[-1] == D and cache.recent.k.shape[-1] == D
  for got, ref in zip(outs, _np_decode(p, kept, channels)):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_recent_size_keeps_the_press_last_kept_keys_whole():
  """``+think:recent_size=r``: the press's last ``r`` kept tokens of each row stay whole (the
  authors prune the keys SnapKV kept but their last ``recent_size``)."""
  r = 4
  m = methods.make(f"snapkv:window_size=8+think:ratio=0.5,window_size={W},recent_size={r}",
                   ratio=0.5)
  p = problem(12)
  _, solo = run(methods.make("snapkv:window_size=8", ratio=0.5), p)
  outs, cache = run(m, p)
  kept = [[k[k < n] for k in row] for row, n in zip(_kept(solo), LENGTHS)]
  channels = _np_channels(p, kept, 0.5)
  np.testing.assert_array_equal(cache.channels, channels)
  pruned, whole = np.asarray(cache.prompt.pos), np.asarray(cache.recent.pos)[..., :r]
  for b in range(B):
    for h in range(HKV):
      np.testing.assert_array_equal(pruned[b, h][:cache.prompt.length[b]], kept[b][h][:-r])
      np.testing.assert_array_equal(whole[b, h], kept[b][h][-r:])
  for got, ref in zip(outs, _np_decode(p, kept, channels, recent=r)):
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)


def test_think_ratio_zero_is_the_press_and_jit_sizes_by_decode_slots():
  p = problem(12)
  plain, _ = run(methods.make("snapkv:window_size=8", ratio=0.5), p)
  same, cache = run(methods.make("snapkv:window_size=8+think:ratio=0", ratio=0.5), p)
  assert type(cache).__name__ == "KVCache"
  for a, b in zip(plain, same):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
  m = methods.make(f"snapkv:window_size=8+think:ratio=0.5,window_size={W}", ratio=0.5)
  eager, c1 = run(m, p)
  slotted = dataclasses.replace(m, decode_slots=T - max(LENGTHS))
  assert slotted.press.decode_slots == T - max(LENGTHS)  # passed down to the press
  jitted, c2 = run(slotted, p, end=jax.jit(slotted.end_prefill))  # traced lengths
  assert c2.prompt.k.shape == c1.prompt.k.shape
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def test_the_spec_options_and_refusals():
  m = methods.make("h2o+think:ratio=0.25,window_size=16", budget=0.25)
  assert (m.spec, m.press.ratio, m.think.ratio, m.think.window_size) == (
      "h2o:ratio=0.75+think:ratio=0.25,window_size=16", 0.75, 0.25, 16)
  assert m.name == "h2o+think" and hash(m) == hash(methods.make(m.spec))
  assert m.memory_access() == pytest.approx(0.25 * (1 - 0.25 / 2))
  assert m.decode_capacity(100, 20) == methods.make("h2o", ratio=0.75).decode_capacity(100, 20)
  state = m.init_state(B, HQ, HKV, D, T)
  assert state["think_obs"]["buf"].shape == (B, 16, HQ, D) and "acc" in state  # H2O's too
  capped = m.with_softcap(50.0)
  assert capped.press.softcap == capped.think.softcap == 50.0
  for bad, match in (("snapkv:head_budget=adakv+think:ratio=0.5", "per-head"),
                     ("snapkv:phase=both+think:ratio=0.5", "phase"),
                     ("snapkv+think:ratio=0.5,kernel=3", "unknown option"),
                     ("think+think:ratio=0.5", "no enhancers"),
                     ("streaming_llm:positions=rolling,rope_theta=1e4+think:ratio=0.5",
                      "own _attend"),
                     ("finch+think:ratio=0.5", "rerotate_keys=false")):
    with pytest.raises(ValueError, match=match):
      methods.make(bad, ratio=0.5)
  prefill(methods.make("streaming_llm+think:ratio=0.5", ratio=0.5), problem(13))
