"""Selectors of one's own: built like the built-ins, run everywhere the built-ins run, and a
custom method that would silently run dense (or skip its selection) raises instead.

The 8-device context-parallel equality of the toy selector is in tests/models/sharded_cases.py.
"""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import modelzoo, quick
from experiments.tasks import accuracy
from models import decode
from sparse_attn import context_parallel, methods, selection, selectors
from sparse_attn.budget import Budget
from sparse_attn.selectors import Quest
from tests.sparse_attn import helpers
from tests.sparse_attn.toy_selector import Centroid


def test_a_method_subclass_with_its_own_selection_is_refused_at_definition():
  """The three constructions of the old notebook way can no longer run: the class is refused,
  with the way to do it instead."""
  with pytest.raises(TypeError, match="a selection rule is a Selector"):
    @dataclasses.dataclass(frozen=True)
    class RecentBlocks(methods.Method):  # pylint: disable=unused-variable
      def select(self, q, cache, scale=None):
        return selection.select_blocks(jnp.zeros(()), cache, self.budget)


def test_a_method_named_for_a_selector_without_one_refuses_to_run_dense():
  with pytest.raises(ValueError, match="would decode as dense attention"):
    methods.Method(spec="recent")
  with pytest.raises(TypeError, match="needs a budget"):
    Centroid()
  with pytest.raises(TypeError, match="abstract"):
    selectors.BlockSelector(budget=0.1)  # no block_scores: it could never select


def test_a_selector_is_built_like_a_builtin_and_registers_as_a_spec_name():
  toy = Centroid(budget=0.1)
  assert toy.budget == Budget(budget=0.1) and toy.granularity == 16 and hash(toy)
  m = methods.Method(selector=toy)
  assert (m.spec, m.name, m.block_size, m.cache_digests) == ("centroid", "centroid", 16,
                                                             ("box", "sphere"))
  made = methods.make("centroid:gqa=group+resa", budget=0.1, block_size=8)
  assert made.selector == Centroid(budget=Budget(budget=0.1), block_size=8, gqa="group")
  assert made.resa is not None and context_parallel.supports(made)
  assert not context_parallel.supports(methods.make("centroid", topp=0.9))  # adaptive rule
  assert selectors.register(Centroid) is Centroid  # the same class again: no error
  with pytest.raises(ValueError, match="taken by Centroid"):
    @dataclasses.dataclass(frozen=True)
    class Other(Centroid):  # pylint: disable=unused-variable
      name = "centroid"
    selectors.register(Other)


def test_its_selection_is_its_own_scores_under_the_budget_rule():
  rng = np.random.default_rng(0)
  cache = helpers.filled_cache(rng, 2, 2, 96, 16, (90, 41), block_size=8)
  q = helpers.normal(rng, (2, 4, 16))
  toy = Centroid(budget=Budget(budget=0.25, n_sink=0, local_window=1), block_size=8)
  got = toy.select(q, cache)
  want = selection.select_blocks(toy.block_scores(q, cache), cache, toy.budget)
  assert not np.array_equal(np.asarray(got.idx), np.asarray(
      Quest(budget=toy.budget, block_size=8).select(q, cache).idx))
  for a, b in ((got.idx, want.idx), (got.n_valid, want.n_valid)):
    np.testing.assert_array_equal(np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1))


def test_it_runs_through_generate_and_the_accuracy_harness(tmp_path):
  model = modelzoo.tiny_random()
  kw = dict(prefill_chunk=16, capacity=64, stop_at_eos=False)
  prompt = list(range(3, 40))
  toy = methods.make("centroid", budget=0.5, block_size=8, n_sink=0, local_window=1)
  assert len(decode.generate(model, prompt, 4, toy, **kw).tokens[0]) == 4
  dense = decode.generate(model, prompt, 4, methods.make("dense", block_size=8), **kw)
  full = methods.make("centroid", budget=1.0, block_size=8)  # every block: dense's tokens
  assert decode.generate(model, prompt, 4, full, **kw).tokens == dense.tokens
  module = __import__("configs.accuracy", fromlist=["get_config"])
  cfg = module.get_config()
  with cfg.unlocked():
    cfg.quick = True
  cfg = quick.resolve(cfg, quick.module_get_config("accuracy"))
  with cfg.unlocked():
    cfg.methods, cfg.pairs, cfg.num_samples = ("centroid",), (), 1
    cfg.tasks = ("niah_single_1",)
  recs = accuracy.run(cfg, os.path.join(tmp_path, "acc"))
  assert {r["method"] for r in recs} == {f"centroid@{b:g}" for b in cfg.budgets}
  assert all(r["attended_tokens"]["chosen"] > 0 for r in recs)
