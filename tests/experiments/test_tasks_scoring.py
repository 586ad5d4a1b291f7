"""Scoring (RULER string match, Wilson intervals, fidelity metrics), specs, top-k reuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import quick, reuse, specs
from experiments.tasks import scoring
from sparse_attn import methods
from sparse_attn.cache import init_cache, write


def test_string_match():
  assert scoring.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
  assert scoring.string_match_all("only 123", ["123", "456"]) == 0.5
  assert scoring.string_match_all("ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
  assert scoring.string_match_part("Denver Broncos won", ["Broncos", "Panthers"]) == 1.0
  assert scoring.string_match_part("nothing", ["Broncos"]) == 0.0
  assert scoring.score("x 5", ["5", "6"], "all") == 0.5
  with pytest.raises(ValueError):
    scoring.string_match_all("x", [])


def test_wilson_interval():
  lo, hi = scoring.wilson(5, 10)
  assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
  lo, hi = scoring.wilson(0, 10)
  assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-3)
  lo, hi = scoring.wilson(3, 3)
  assert hi == 1.0 and lo == pytest.approx(0.4385, abs=1e-3)
  assert scoring.wilson(0, 0) == (0.0, 1.0)


def test_sequence_fidelity_metrics():
  assert scoring.first_divergence([1, 2, 3], [1, 2, 4]) == 2
  assert scoring.first_divergence([1, 2], [1, 2, 3]) == 2
  assert scoring.edit_distance([1, 2, 3], [1, 3]) == 1
  assert scoring.edit_distance("kitten", "sitting") == 3
  assert scoring.edit_similarity([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
  assert scoring.edit_similarity([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0
  assert scoring.edit_similarity([], []) == 1.0


def test_specs_expand():
  rows = specs.expand(["dense", "quest", "quest+rect:f=8", "quest:p=0.1", "snapkv",
                       "quest+reuse:every=3"], [0.05, 0.2])
  labels = [r.label for r in rows]
  assert labels == ["dense", "quest@0.05", "quest@0.2", "quest+rect:f=8@0.05",
                    "quest+rect:f=8@0.2", "quest:p=0.1", "snapkv@0.05", "snapkv@0.2",
                    "quest+reuse:every=3@0.05", "quest+reuse:every=3@0.2"]
  by = {r.label: r.method for r in rows}
  assert by["quest@0.05"].budget.budget == 0.05 and by["quest+rect:f=8@0.2"].rect_interval == 8
  assert by["snapkv@0.05"].ratio == pytest.approx(0.95)
  assert by["quest+reuse:every=3@0.2"].reuse_every == 3
  assert specs.build("quest+track", 0.1).reuse_every == 0
  with pytest.raises(ValueError, match="plain selector"):
    specs.build("quest+resa+reuse", 0.1)
  with pytest.raises(ValueError, match="unknown option"):
    specs.build("quest+reuse:often=2", 0.1)


def test_quick_config_resolution():
  import configs.accuracy as acc  # pylint: disable=g-import-not-at-top
  c = acc.get_config()
  with c.unlocked():
    c.quick = True
    c.num_samples = 7  # given explicitly: kept
  r = quick.resolve(c, quick.module_get_config("accuracy"))
  assert r.model == "tiny-random" and r.num_samples == 7
  assert tuple(r.lengths) == tuple(acc.get_config(True).lengths)
  assert quick.resolve(acc.get_config(), acc.get_config).model == acc.get_config().model


def _random_cache(rng, b=2, hkv=2, t=96, d=8, bs=8, length=80):
  cache = init_cache(b, hkv, t, d, bs, jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, hkv, length, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, hkv, length, d)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
  return write(cache, k, v, pos)


def test_tracking_does_not_change_outputs_and_reuse_reuses():
  rng = np.random.default_rng(0)
  base = methods.make("quest", budget=0.2, block_size=8, local_window=8)
  track = reuse.TrackedMethod.wrap(base, "quest+track")
  every = reuse.TrackedMethod.wrap(base, "quest+reuse", reuse_every=2)
  cache = _random_cache(rng)
  st_t = track.init_state(2, 4, 2, 8, 96)
  st_r = every.init_state(2, 4, 2, 8, 96)
  dec = jax.jit(lambda m, *a: m.decode(*a), static_argnums=0)
  c_b = c_t = c_r = cache
  for step in range(4):
    p = 80 + step
    q = jnp.asarray(rng.normal(size=(2, 4, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 1, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 1, 8)), jnp.float32)
    pos = jnp.full((2, 1), p, jnp.int32)
    o_b, c_b, _ = dec(base, q, k, v, c_b, {}, pos)
    o_t, c_t, st_t = dec(track, q, k, v, c_t, st_t, pos)
    prev = st_r
    o_r, c_r, st_r = dec(every, q, k, v, c_r, st_r, pos)
    np.testing.assert_allclose(o_t, o_b, atol=1e-6)
    ov = np.asarray(st_t["overlap"])
    assert np.isnan(ov).all() if step == 0 else ((ov >= 0) & (ov <= 1)).all()
    if step % 2 == 1:  # a reuse step: the previous list, plus the new token's block if missing
      old = {int(i) for i in np.asarray(prev["idx"])[0, 0, :int(prev["n_valid"][0, 0])]}
      new = {int(i) for i in np.asarray(st_r["idx"])[0, 0, :int(st_r["n_valid"][0, 0])]}
      assert new == old | {p // 8}
    else:
      np.testing.assert_allclose(o_r, o_b, atol=1e-6)


def test_with_entry_appends_missing_entry_only():
  idx = jnp.asarray([[[3, 5, 0, 0], [1, 2, 3, 4]]], jnp.int32)
  n = jnp.asarray([[2, 4]], jnp.int32)
  out, n2 = reuse._with_entry(idx, n, jnp.asarray([7]))  # pylint: disable=protected-access
  assert np.asarray(out)[0, 0, :3].tolist() == [3, 5, 7] and np.asarray(n2).tolist() == [[3, 4]]
  out, n2 = reuse._with_entry(idx, n, jnp.asarray([5]))  # pylint: disable=protected-access
  assert np.asarray(n2).tolist() == [[2, 4]]


def test_per_question_scores_each_answer_in_its_own_segment():
  refs = [["Denver Broncos"], ["Santa Clara", "Levi's Stadium"], ["2016"]]
  pred = " Denver Broncos\nAnswer 2: Levi's Stadium\nAnswer 3: in 2015"
  assert scoring.answer_segments(pred, 3) == [" Denver Broncos\n", " Levi's Stadium\n",
                                               " in 2015"]
  assert scoring.per_question(pred, refs) == [1.0, 1.0, 0.0]
  assert scoring.score(pred, refs, "each") == pytest.approx(2 / 3)
  # an answer under the wrong label does not count for another question
  assert scoring.per_question(" x\nAnswer 3: Santa Clara", refs) == [0.0, 0.0, 0.0]
  assert scoring.per_question("", refs) == [0.0, 0.0, 0.0]
  # a repeated label keeps its first answer (a second try does not overwrite it)
  again = " x\nAnswer 2: Santa Clara\nAnswer 2: nowhere\nAnswer 1: Denver Broncos"
  assert scoring.answer_segments(again, 3) == [" x\n", " Santa Clara\n", ""]
  assert scoring.per_question(again, refs) == [0.0, 1.0, 0.0]
  with pytest.raises(ValueError, match="unknown metric"):
    scoring.score("x", ["x"], "some")
