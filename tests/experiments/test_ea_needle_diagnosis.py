"""``experiments.analysis.ea_needle_diagnosis``: the measures on cases with a known answer,
and a quick run whose recomputed kept sets equal the method's own prefill + eviction."""

import numpy as np
import pytest

from configs import ea_needle_diagnosis as config_lib
from experiments.analysis import ea_needle_diagnosis as diag
from experiments.common import results
from experiments.tasks import haystack


def test_question_attention_per_key_matches_a_brute_force_softmax():
  rng = np.random.default_rng(0)
  layers, n, kv, s, d, ctx = 2, 4, 2, 9, 8, 6
  q, k = rng.normal(size=(layers, n, s, d)), rng.normal(size=(layers, kv, s, d))
  got = diag.question_attention_per_key(q, k, 0.5, ctx)
  assert got.shape == (layers, kv, ctx)
  want = np.zeros((layers, n, ctx))
  for li in range(layers):
    for h in range(n):
      for t in range(ctx, s):
        logits = 0.5 * k[li, h // 2, :t + 1] @ q[li, h, t]
        p = np.exp(logits - logits.max())
        want[li, h] += (p / p.sum())[:ctx] / (s - ctx)
  np.testing.assert_allclose(got, want.reshape(layers, kv, 2, ctx).mean(2), rtol=1e-10)


def test_top_keep_forces_sinks_and_takes_the_best():
  score = np.array([[0.0, 0.0, 5.0, 1.0, 3.0, 2.0]])
  np.testing.assert_array_equal(diag.top_keep(score, np.array([3]), 1),
                                [[True, False, True, False, True, False]])


def test_head_measures_on_a_known_case():
  s, sink, span = 12, 2, (3, 5)
  true = np.linspace(1.0, 2.0, s)[None, None] * np.ones((1, 2, s))
  true[..., 3:5] = 10.0  # the needle is what the question reads
  keep_recent = np.arange(s) >= s - 5
  keep_recent[:sink] = True
  view = dict(score=true.copy(), a_hat=true[..., ::-1].copy(), score_question=true.copy(),
              keep=np.broadcast_to(keep_recent, true.shape).copy(),
              keep_uniform=np.broadcast_to(keep_recent, true.shape).copy(),
              keep_question=np.broadcast_to(keep_recent, true.shape).copy())
  m = diag.head_measures(view, true, span, sink)
  np.testing.assert_allclose(m["rho_score"], 1.0)
  assert np.all(m["rho_a_hat"] < 0) and np.all(m["rho_pos_true"] > 0)
  np.testing.assert_allclose(m["kept_oracle"], 1.0)  # 5 kept per head: the needle is the top
  np.testing.assert_allclose(m["kept_recent"], 0.0)
  np.testing.assert_allclose(m["kept_ea"], 0.0)
  row = diag.summarize(m)
  assert row["kept_oracle"] == pytest.approx(1.0) and row["rho_score"] == pytest.approx(1.0)
  assert row["needle_mass"] == pytest.approx(20.0 / true[0, 0, sink:].sum())


def test_quick_run_reads_what_the_method_keeps(tmp_path, monkeypatch):
  # RULER's key pool (every adjective-noun pair, sorted) takes ~15 s to build; a few suffice
  monkeypatch.setattr(haystack, "key_words", lambda: ("red-apple", "blue-sky", "old-boat"))
  c = config_lib.get_config(True)
  with c.unlocked():
    c.lengths, c.num_samples, c.depths = (192,), 1, (0.2,)
  rows = diag.run(c, str(tmp_path))
  assert (tmp_path / f"{diag.NAME}.md").exists() and (tmp_path / f"{diag.NAME}.png").exists()
  (rec,) = results.read_records(str(tmp_path / results.RESULTS_FILE))
  assert len(rows) == 1 and rec["depth"] == 0.2
  assert rec["pipeline_agreement"] == 1.0  # ea_layer's kept set is the pipeline's, exactly
  for name in diag.KEEPS:
    assert 0.0 <= rec[f"kept_{name}"] <= 1.0 + 1e-9
  p = rec["profile"]
  assert len(p["score"]) == len(p["true"]) == rec["context_tokens"] - p["first"]
  assert sum(p["score"]) == pytest.approx(1.0, abs=1e-4)
