"""ShadowKV's ``attended_tokens`` counts its outlier blocks (issue 52): the tokens a decode step
reads per kv head, brute-forced from the selection's token mask on random caches, equal
``Method.attended_tokens``'s total, its forced part holds the sinks, local window and outliers,
and the blocks are disjoint (no token counted twice)."""

import numpy as np
import pytest

from experiments.common import sparsity
from sparse_attn import methods
from tests.sparse_attn import helpers

BS, D, CAP = 4, 8, 96


def _np_count(context, n_sink, local, n_out, count, inside=False):
  """Brute force of one kv head: blocks forced (sinks, local window), then up to ``n_out``
  outlier blocks of the rest, then ``count`` more (or up to ``count`` in all, ``inside``)."""
  m = -(-context // BS)
  forced = {i for i in range(m) if i * BS < n_sink or (local and (i + 1) * BS > context - local)}
  out = min(n_out, m - len(forced))
  total = (max(count, len(forced)) if inside else count + len(forced)) + out
  return min(m, total) * BS, len(forced) * BS + out * BS, out * BS


@pytest.mark.parametrize("opts", [
    dict(outliers=3, budget=2 * BS),
    dict(outliers=5, budget=BS, n_sink=BS, local_window=2 * BS),
    dict(outliers=2, budget=6 * BS, forced_count="inside"),
    dict(outliers=48, budget=2 * BS),  # more outliers than blocks: every block
    dict(outlier_share=0.1, budget=2 * BS),  # ceil(0.1 x blocks): 3 / 2 / 1 at 96 / 64 / 40
    dict(outlier_share=1.0, budget=BS),  # every block an outlier
])
def test_attended_tokens_equal_the_tokens_the_selection_reads(opts):
  m = methods.make("shadowkv", block_size=BS, impl="xla", **opts)
  rng = np.random.default_rng(0)
  lengths = [96, 64, 40]  # whole blocks: the last one is in the local window anyway
  cache = helpers.filled_cache(rng, 3, 2, CAP, D, lengths, BS)
  sel = m.select(helpers.normal(rng, (3, 6, D)), cache)
  mask = np.asarray(sel.token_mask(CAP))  # [B, K, T]
  idx, n_valid = np.asarray(sel.idx), np.asarray(sel.n_valid)
  b = m.budget
  for row, ctx in enumerate(lengths):
    acc = m.attended_tokens(ctx)
    for h in range(2):
      picked = idx[row, h, :n_valid[row, h]]
      assert len(set(picked.tolist())) == len(picked)  # disjoint: no block twice
      assert int(mask[row, h, :ctx].sum()) == acc["total"], (opts, ctx)
      assert not mask[row, h, ctx:].any()
    share = opts.get("outlier_share")
    n_out = opts["outliers"] if share is None else int(np.ceil(share * -(-ctx // BS)))
    total, forced, out = _np_count(ctx, b.n_sink, b.local_window, n_out,
                                   -(-b.budget // BS), b.forced_count == "inside")
    assert (acc["total"], acc["forced"], acc["outliers"]) == (total, forced, out), (opts, ctx)
    assert acc["forced"] + acc["chosen"] == acc["total"] and acc["context"] == ctx


def test_the_outliers_are_on_top_of_quests_count_and_reported():
  """Before issue 52 ShadowKV reported Budget.accounting alone: the outliers were missing."""
  m = methods.make("shadowkv", budget=64, outliers=8, impl="xla")  # 16-token blocks
  acc = m.attended_tokens(2048)
  plain = m.budget.accounting(2048, 16)
  assert acc["total"] == plain["total"] + 8 * 16 and acc["outliers"] == 8 * 16
  assert acc["chosen"] == plain["chosen"] == 64
  att = sparsity.attended(m, 2048)
  assert att.tokens == acc["total"] and "128 in outlier blocks" in att.detail
  assert methods.make("quest", budget=0.05).attended_tokens(2048).get("outliers") is None
