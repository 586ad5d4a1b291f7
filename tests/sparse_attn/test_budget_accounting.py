"""Budget accounting as each paper states it, paper presets, and RESA's lambda options."""

import math

import numpy as np
import pytest

from sparse_attn import budget as budget_lib
from sparse_attn import methods
from tests.sparse_attn import helpers


def _np_accounting(context, unit, n_sink, local, count, extra):
  """Brute force: entry tokens, forced entries (sink or local window), chosen = the rest."""
  m = -(-context // unit)
  tokens = [min(unit, context - e * unit) for e in range(m)]
  forced = [e for e in range(m) if e * unit < n_sink or local(e)]
  total = min(m, count + len(forced) if extra else max(count, len(forced)))
  f_tok = sum(tokens[e] for e in forced)
  rest = sorted((tokens[e] for e in range(m) if e not in forced), reverse=True)
  c_tok = sum(rest[:total - len(forced)])
  return dict(forced=f_tok, chosen=c_tok, total=f_tok + c_tok, context=context)


@pytest.mark.parametrize("context", [1024, 2048, 8192, 5000])
def test_each_papers_rule_matches_its_rendering(context):
  bs = 16
  window = lambda e, w: (e + 1) * bs > context - w
  # RESA Sec. 5: 2.5% chosen, 4 sinks + 64 local tokens on top.
  resa = methods.make("resa-quest").attended_tokens(context)
  assert resa == _np_accounting(context, bs, 4, lambda e: window(e, 64),
                                math.ceil(0.025 * context / bs), extra=True)
  # ReSA Eq. 4: n = max(n_min, ceil(M p)) blocks, the n_local = 1 block counted inside, no sink.
  m_blocks = -(-context // bs)
  resa_rule = methods.make("rectified").attended_tokens(context)
  assert resa_rule == _np_accounting(context, bs, 0, lambda e: e >= m_blocks - 1,
                                     max(16, math.ceil(m_blocks * 0.1)), extra=False)
  # RetroAttention Table 1: 0.15 of the context, at least 256 tokens, the current page inside.
  retro = methods.make("retro").attended_tokens(context)
  assert retro == _np_accounting(context, bs, 0, lambda e: window(e, 1),
                                 max(math.ceil(0.15 * context / bs), 256 // bs), extra=False)


def test_quest_at_5_percent_of_2048_chooses_7_blocks_by_score():
  """Pinned (issue 13): sinks and local window must not eat Quest's 5% budget."""
  m = methods.make("quest", budget=0.05)
  rng = np.random.default_rng(0)
  cache = helpers.filled_cache(rng, 1, 2, 2048, 8, [2048])
  sel = m.select(helpers.normal(rng, (1, 4, 8)), cache)
  forced = int(np.sum(np.asarray(m.budget.forced(cache.length, 128, 16))))
  assert forced == 1 + 4  # the sink block and the 64-token local window
  assert np.all(np.asarray(sel.n_valid) - forced >= math.ceil(0.05 * 2048 / 16))
  acc = m.attended_tokens(2048)
  assert acc["chosen"] == 7 * 16 and acc["forced"] == 5 * 16


def test_selection_matches_accounting():
  rng = np.random.default_rng(1)
  for spec, ctx in (("resa-quest", 1000), ("rectified", 3000), ("retro", 700),
                    ("quest", 333), ("topk", 257)):
    m = methods.make(spec)
    cache = helpers.filled_cache(rng, 1, 1, m.round_capacity(ctx), 8, [ctx])
    sel = m.select(helpers.normal(rng, (1, 1, 8)), cache)
    covered = int(np.asarray(sel.token_mask(cache.capacity))[0, 0, :ctx].sum())
    assert covered == m.attended_tokens(ctx)["total"], spec


def test_choosing_nothing_by_score_is_refused_with_the_numbers():
  m = methods.make("quest", budget=0.05, forced_count="inside")
  with pytest.raises(ValueError, match=r"chooses 0 blocks by score at a context of 1024 tokens"):
    m.check_context(1024)
  m.check_context(4096)  # 13 blocks, 6 forced: 7 chosen
  methods.make("quest", budget=0.05).check_context(1024)  # forced on top: fine
  methods.make("streaming", budget=0.05, forced_count="inside").check_context(1024)  # no scores
  methods.make("quest", budget=0.05, forced_count="inside").check_context(64)  # all attended


def test_budget_options_are_validated():
  with pytest.raises(ValueError, match="forced_count"):
    methods.make("quest", forced_count="outside")
  with pytest.raises(ValueError, match="min_tokens"):
    budget_lib.Budget(budget=0.1, min_tokens=-1)
  assert budget_lib.Budget(budget=0.1).forced_count == "extra"
  assert budget_lib.Budget(budget=None, p=0.1).forced_count == "inside"


def test_presets_carry_the_papers_settings():
  assert set(methods.PRESETS) >= {"resa-quest", "resa-arkvale", "resa-topk", "rectified",
                                  "retro", "expected-attention"}
  for name in methods.PRESETS:
    methods.make(name)
  r = methods.make("resa-quest")
  assert (r.name, r.resa.lam, r.resa.prior_update, r.resa.typical_query) == (
      "quest", 1.0, "prefill_only", "mean")
  assert (r.budget.budget, r.budget.n_sink, r.budget.local_window, r.budget.forced_count) == (
      0.025, 4, 64, "extra")
  assert methods.make("resa-arkvale").name == "arkvale"
  assert methods.make("resa-topk").name == "topk"
  rect = methods.make("rectified")
  assert (rect.selector.gqa, rect.rect_interval, rect.budget.p, rect.budget.n_min, rect.budget.n_local,
          rect.budget.n_sink, rect.budget.forced_count) == ("group", 32, 0.1, 16, 1, 0, "inside")
  retro = methods.make("retro")
  assert (retro.window, retro.budget.budget, retro.budget.min_tokens) == (2, 0.15, 256)
  ea = methods.make("expected-attention")
  assert (ea.head_budget, ea.n_future, ea.eps, ea.use_covariance, ea.use_vnorm) == (
      "adakv", 512, 0.01, True, True)
  # keywords override the preset
  assert methods.make("resa-quest", budget=0.05).budget.budget == 0.05
  assert methods.make("resa-quest", lam=0.5).resa.lam == 0.5
  assert methods.make("RESA-Quest").spec == methods.PRESETS["resa-quest"]
  with pytest.raises(ValueError, match="presets"):
    methods.make("resa-qeust")


def test_resa_defaults_and_lambda_range():
  m = methods.make("quest+resa")
  assert (m.resa.prior_update, m.resa.lam, m.resa.lam_form) == ("prefill_only", 1.0, "renormalised")
  for bad in (1.5, -0.1):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
      methods.make("quest+resa", lam=bad)
  with pytest.raises(ValueError, match="lam_form"):
    methods.make("quest+resa:lam_form=other")
  assert methods.make("quest+resa:lam_form=literal").resa.lam_form == "literal"
