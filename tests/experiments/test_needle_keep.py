"""``experiments.analysis.kept_tokens``: kept positions of both cache layouts against a
brute-force set reading, the needle's token span, the summary numbers, and a quick run whose
StreamingLLM row keeps exactly its sinks and the recent half."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from configs import needle_keep as nk_config
from experiments.analysis import kept_tokens, needle_keep
from experiments.common import results
from sparse_attn import cache as cache_lib
from sparse_attn.compression import flat


def _brute(pos, valid, owner, num_kv_heads, s):
  """``[B, K, S]`` from explicit per-slot loops: slot j of row b counts for head owner[b, j]."""
  b_, t = pos.shape[0], pos.shape[-1]
  out = np.zeros((b_, num_kv_heads, s), bool)
  for b in range(b_):
    for k in range(num_kv_heads):
      for j in range(t):
        p = pos[b, k, j] if pos.ndim == 3 else pos[b, j]
        ok = valid[b, k, j] if valid.ndim == 3 else valid[b, j] and owner[b, j] == k
        if ok and 0 <= p < s:
          out[b, k, p] = True
  return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), heads=st.integers(1, 4),
       slots=st.sampled_from([16, 32]), s=st.integers(1, 40))
def test_kept_mask_matches_a_slot_by_slot_reading(seed, batch, heads, slots, s):
  rng = np.random.default_rng(seed)
  length = rng.integers(0, slots + 1, (batch,)).astype(np.int32)
  # per-head cache: random positions (some empty), some slots past `length`
  pos = np.where(rng.random((batch, heads, slots)) < 0.2, -1,
                 rng.integers(0, 48, (batch, heads, slots))).astype(np.int32)
  c = dataclasses.replace(cache_lib.init_cache(batch, heads, slots, 4, 16),
                          pos=jnp.asarray(pos), length=jnp.asarray(length))
  got = kept_tokens.kept_mask(c, s)
  assert got.shape == (batch, heads, s)
  np.testing.assert_array_equal(got, _brute(pos, np.asarray(c.valid), None, heads, s))
  # flat Ada-KV buffer: one row of slots, a kv-head id per slot
  fpos = pos.reshape(batch, -1)[:, :slots]
  owner = rng.integers(0, heads, (batch, slots)).astype(np.int8)
  f = flat.FlatKVCache(k=jnp.zeros((batch, slots, 4)), v=jnp.zeros((batch, slots, 4)),
                       pos=jnp.asarray(fpos), head=jnp.asarray(owner),
                       length=jnp.asarray(length), num_kv_heads=heads, block_size=16)
  np.testing.assert_array_equal(kept_tokens.kept_mask(f, s),
                                _brute(fpos, np.asarray(f.valid), owner, heads, s))


def test_needle_span_counts_tokens_up_to_the_needle():
  chars = list  # one token per character: the span is the character span, shifted
  prompt = "<head>ctx with NEEDLE inside</head>?"
  context = "ctx with NEEDLE inside"
  a = context.index("NEEDLE")
  span = kept_tokens.needle_token_span(chars, prompt, context, (a, a + 6), num_context=28)
  assert span == (6 + a, 6 + a + 6)
  assert kept_tokens.needle_token_span(chars, prompt, context, (a, a + 6), 18) == (15, 18)
  with pytest.raises(ValueError, match="past the context"):
    kept_tokens.needle_token_span(chars, prompt, context, (a, a + 6), 10)


def test_keep_summary_numbers():
  kept = np.zeros((2, 2, 12), bool)  # [L, K, S]; positions >= 10 are padding
  kept[0, 0, 3:5] = True  # layer 0 head 0 keeps the whole needle (3, 5)
  kept[1, :, 4] = True  # layer 1 keeps half of it in both heads
  kept[:, :, 10:] = True  # padding: must not count
  out = kept_tokens.keep_summary(kept, 10, (3, 5))
  assert out["needle_recall"] == pytest.approx(4 / 8)
  assert out["needle_recall_per_layer"] == pytest.approx([0.5, 0.5])
  assert out["heads_with_needle"] == pytest.approx(3 / 4)
  assert out["kept_fraction"] == pytest.approx(4 / 40)
  assert len(out["position_profile"]) == kept_tokens.POSITION_BINS
  assert out["position_profile"][4] == pytest.approx(3 / 4)  # position 4: 3 of 4 layer-heads


def test_question_attention_matches_a_per_query_softmax():
  rng = np.random.default_rng(1)
  layers, n, kv, s, d = 2, 4, 2, 12, 8
  q = rng.normal(size=(layers, n, s, d)).astype(np.float32)
  k = rng.normal(size=(layers, kv, s, d)).astype(np.float32)
  got = kept_tokens.question_attention(q, k, 0.5, 9, (3, 5))
  want = np.zeros((layers, kv))
  for layer in range(layers):
    for h in range(n):
      masses = []
      for t in range(9, s):
        z = 0.5 * k[layer, h // (n // kv), :t + 1] @ q[layer, h, t]
        p = np.exp(z - z.max())
        p /= p.sum()
        masses.append(p[3:5].sum())
      want[layer, h // (n // kv)] += np.mean(masses) / (n // kv)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert kept_tokens.weighted_recall([[1.0, 0.0]], [[3.0, 1.0]]) == pytest.approx(0.75)


def test_quick_run_streaming_llm_keeps_sinks_and_the_recent_half(tmp_path):
  c = nk_config.get_config(True)
  with c.unlocked():
    c.methods = tuple(c.methods) + ("streaming_llm",)
  rows = needle_keep.run(c, str(tmp_path))
  assert (tmp_path / "needle_keep.md").exists() and (tmp_path / "needle_keep.png").exists()
  recs = results.read_records(str(tmp_path / results.RESULTS_FILE))
  assert len(recs) == len(c.methods) * c.num_samples and len(rows) == len(c.methods)
  for r in recs:
    assert 0.0 <= r["needle_recall"] <= 1.0 and 0.45 <= r["kept_fraction"] <= 0.56, r
    a, b = r["needle_tokens"]
    assert 0 <= a < b <= r["context_tokens"]
    att = np.asarray(r["question_attention"])
    assert att.shape == np.asarray(r["needle_recall_per_head"]).shape and att.ndim == 2
    assert np.all((att >= 0) & (att <= 1)) and 0.0 <= r["weighted_recall"] <= 1.0
  for r in (r for r in recs if r["method"].startswith("streaming_llm")):
    prof = r["position_profile"]
    assert prof[-1] == 1.0 and prof[-2] == 1.0 and max(prof[1:4]) == 0.0, prof
    expect = 1.0 if r["depth"] >= 0.8 else 0.0  # the needle lies in the kept recent half or not
    assert r["needle_recall"] == pytest.approx(expect, abs=0.2), r
