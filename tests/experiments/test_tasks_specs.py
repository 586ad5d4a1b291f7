"""``experiments.common.specs``: budgets map to every family, the model's RoPE reaches EA."""

import pytest

from experiments.common import modelzoo, specs


def test_budget_means_kept_fraction_for_every_family():
  assert specs.build("quest", 0.05).budget.budget == 0.05
  assert specs.build("expected_attention", 0.05).ratio == pytest.approx(0.95)
  assert specs.build("quest:budget=256", None).budget.budget == 256
  labels = [e.label for e in specs.expand(["dense", "quest", "snapkv"], [0.1, 0.2])]
  assert labels == ["dense", "quest@0.1", "quest@0.2", "snapkv@0.1", "snapkv@0.2"]


def test_rope_frequencies_reach_methods_that_model_rope():
  freqs = modelzoo.rope_inv_freq(modelzoo.tiny_random())
  assert len(freqs) == modelzoo.tiny_random().config.head_dim // 2
  ea = specs.build("expected_attention", 0.5, rope_inv_freq=freqs)
  assert ea.rope_inv_freq == freqs
  own = specs.build("expected_attention:rope_theta=500000", 0.5, rope_inv_freq=freqs)
  assert own.rope_inv_freq is None and own.rope_theta == 500000
  assert specs.build("quest", 0.1, rope_inv_freq=freqs).budget.budget == 0.1  # ignored


def test_presets_take_budgets_unless_their_rule_is_their_own():
  """resa-quest and expected-attention are crossed with the budgets; ReSA's p rule and
  RetroAttention's relative budget with its minimum are not; inline options override."""
  rows = specs.expand(["dense", "resa-quest", "rectified", "rectified:p=0.02", "retro",
                       "expected-attention:eps=0"], [0.025, 0.5])
  by = {e.label: e.method for e in rows}
  assert list(by) == ["dense", "resa-quest@0.025", "resa-quest@0.5", "rectified",
                      "rectified:p=0.02", "retro", "expected-attention:eps=0@0.025",
                      "expected-attention:eps=0@0.5"]
  resa = by["resa-quest@0.025"]
  assert resa.resa and resa.budget.budget == 0.025 and resa.budget.forced_count == "extra"
  assert by["rectified:p=0.02"].budget.p == 0.02 and by["rectified:p=0.02"].rect_interval == 32
  assert by["retro"].budget.min_tokens == 256 and by["retro"].window == 2
  ea = by["expected-attention:eps=0@0.5"]
  assert ea.eps == 0 and ea.ratio == pytest.approx(0.5) and ea.head_budget == "adakv"
  assert specs.base_name("resa-arkvale") == "arkvale"
  with pytest.raises(ValueError, match="no enhancers"):
    specs.build("resa-quest+retro", 0.1)


@pytest.mark.parametrize("spec", ["quest", "snapkv"])
def test_a_bad_budget_raises_what_methods_make_raises(spec):
  from sparse_attn import methods
  with pytest.raises(ValueError) as made:
    methods.make("quest", budget=1.5)
  with pytest.raises(ValueError) as built:
    specs.build(spec, 1.5)  # once truncated to a 1-token budget
  assert str(built.value) == str(made.value) == "a fractional budget must be in (0, 1], got 1.5"


def test_a_whole_float_budget_is_a_token_count():
  assert specs.build("quest", 256.0).selector.budget.budget == 256
  assert specs.build("quest", 0.25).selector.budget.budget == 0.25
  with pytest.raises(ValueError, match="keeps a fraction of the context"):
    specs.build("snapkv", 256.0)


def test_a_spec_at_one_budget_runs_there_only():
  rows = specs.expand(["quest", "resa-quest:lam=0.25@0.025"], [0.025, 0.1])
  assert [(e.label, e.budget) for e in rows] == [
      ("quest@0.025", 0.025), ("quest@0.1", 0.1), ("resa-quest:lam=0.25@0.025", 0.025)]
  method = rows[-1].method
  assert method.resa.lam == 0.25 and method.selector.budget.budget == 0.025
  with pytest.raises(ValueError, match="rule of its own"):
    specs.expand(["rectified@0.05"], [0.1])


def test_calibrated_rows_set_the_saved_per_head_lambda_after_prefill(tmp_path, monkeypatch):
  """``+calibrated:fit=DIR``: the base method, labelled apart, with the per-head parameters
  that ``experiments.resa_calibrate`` saved set on every layer's state."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments.common import checkpoint  # pylint: disable=g-import-not-at-top
  from models import decode  # pylint: disable=g-import-not-at-top
  model = modelzoo.tiny_random()
  nl, nh = model.config.num_layers, model.config.num_heads
  log_lam = np.log(np.linspace(0.2, 0.9, nl * nh, dtype=np.float32)).reshape(nl, nh)
  monkeypatch.chdir(tmp_path)
  checkpoint.save_arrays("fit", dict(log_lam=log_lam, beta=np.ones_like(log_lam)))
  row, = specs.expand(["resa-quest+calibrated:fit=fit@0.1"], [0.5], block_size=8)
  plain, = specs.expand(["resa-quest@0.1"], [], block_size=8)
  assert row.label == "resa-quest+calibrated:fit=fit@0.1" and row.budget == 0.1
  assert row.method == plain.method and plain.after_prefill is None
  assert specs.base_name(row.spec) == "quest"
  tokens = np.arange(40, dtype=np.int32)[None] % model.config.vocab_size
  *_, states = decode.prefill(model, tokens, np.array([40]), row.method, 64, 16)
  states = row.after_prefill(states)
  for layer, st in enumerate(states):
    np.testing.assert_allclose(st.resa.head_log_lam[0], log_lam[layer], rtol=1e-6)
  with pytest.raises(ValueError, match="lam = 1"):
    specs.expand(["resa-quest:lam=0.5+calibrated:fit=fit@0.1"], [])
  with pytest.raises(ValueError, match="no calibration at"):
    specs.expand(["resa-quest+calibrated:fit=elsewhere@0.1"], [])
  with pytest.raises(ValueError, match="comes last"):
    specs.expand(["quest+calibrated:fit=fit+resa@0.1"], [])


def test_a_budget_reaches_methods_make_as_is():
  """``specs.build`` hands the budget to ``methods.make``, which turns it into a ratio."""
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top
  assert specs.build("snapkv", 0.1) == methods.make("snapkv", budget=0.1) == methods.make(
      "snapkv", ratio=0.9)
  assert specs.build("snapkv:budget=0.25", None) == methods.make("snapkv", ratio=0.75)
  assert specs.has_own_budget("snapkv:budget=0.25")


def test_each_spec_is_parsed_once(monkeypatch):
  calls = []
  parse = specs.parse
  monkeypatch.setattr(specs, "parse", lambda s: calls.append(s) or parse(s))
  labels = [e.label for e in specs.expand(
      ["dense", "quest+reuse:every=3", "resa-quest:lam=0.25@0.025", "rectified"], [0.1, 0.2])]
  assert labels == ["dense", "quest+reuse:every=3@0.1", "quest+reuse:every=3@0.2",
                    "resa-quest:lam=0.25@0.025", "rectified"]
  assert calls == ["dense", "quest+reuse:every=3", "resa-quest:lam=0.25@0.025", "rectified"]


@pytest.mark.parametrize("spec,fields", [
    ("dense", dict(base="dense", family="dense", own_budget=True)),
    ("snapkv", dict(base="snapkv", family="snapkv", own_budget=False)),
    ("quest:budget=256", dict(family="quest", own_budget=True)),
    ("quest+track", dict(base="quest", wrapper="track", every=0)),
    ("quest+reuse", dict(base="quest", wrapper="reuse", every=2)),
    ("expected-attention:eps=0@0.5", dict(
        text="expected-attention:eps=0", base="expected-attention:eps=0",
        family="expected_attention", preset="expected-attention",
        preset_options=(("eps", 0),), at_budget=0.5, own_budget=False)),
    ("rectified", dict(preset="rectified", family="quest", own_budget=True)),
    ("resa-quest+calibrated:fit=dir@0.025", dict(
        text="resa-quest+calibrated:fit=dir", base="resa-quest", fit="dir", at_budget=0.025)),
    ("quest@256", dict(at_budget=256)),
])
def test_parsed_spec_fields(spec, fields):
  p = specs.parse(spec)
  assert {k: getattr(p, k) for k in fields} == fields
  assert specs.base_name(spec) == p.family and specs.has_own_budget(spec) == p.own_budget


@pytest.mark.parametrize("spec,match", [
    ("quest+reuse:every=2,k=1", "unknown option"), ("resa-quest+retro", "no enhancers"),
    ("quest+calibrated:fit=a+resa", "comes last"), ("quest@1.5", "must be in")])
def test_malformed_specs_raise_when_parsed(spec, match):
  with pytest.raises(ValueError, match=match):
    specs.parse(spec)
