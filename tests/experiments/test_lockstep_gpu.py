"""The GPU configs' path of the perplexity and long-generation experiments, under CPU JAX.

``configs/perplexity_gpu.py`` and ``configs/long_generation_gpu.py`` (``batch_plan=True``): the
methods in lockstep groups beside dense with batches from the memory plan, each method
prefilled on its own in chunks (SnapKV in sub-batches whose compacted caches are joined), the
decode step forced to one device program as on a GPU. On tiny-random in float32 this gives the
per-layer, shared-prefill CPU loop's per-token NLL (ragged documents too) and generated tokens.
"""

import numpy as np
import pytest

from configs import long_generation_gpu, perplexity_gpu
from experiments.common import modelzoo, quick, specs
from experiments.tasks import decoding, long_generation, perplexity, planned


def _config(module, **kw):
  c = module.get_config()
  with c.unlocked():
    c.quick = True
  c = quick.resolve(c, module.get_config)
  with c.unlocked():
    c.update(kw)
  return c


def _methods(*specs_, block_size=16):
  return {s: specs.build(s, block_size=block_size) for s in specs_}


def test_lockstep_one_program_equals_per_layer_on_ragged_documents():
  model = modelzoo.tiny_random().in_decode_layout()
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 1000, size=(3, 120)).astype(np.int32)
  starts = np.array([100, 77, 112], np.int32)  # each row predicts 120 - 112 = 8 tokens
  for row, start in enumerate(starts):
    tokens[row, start + 8:] = 0  # right padding past the row's end
  methods = _methods("dense", "quest:budget=0.3", "snapkv:ratio=0.5")
  want = decoding.lockstep(model, tokens, starts, methods, fused=False, prefill_chunk=32)
  opts = planned.Options(prefill_chunk=32, decode_step="program", lockstep_methods=1)
  groups = planned.lockstep_groups(model, methods, "dense", opts, capacity=120,
                                   longest_prompt=int(starts.max()), max_batch=3)
  assert [list(m) for m, _ in groups] == [["dense", "quest:budget=0.3"],
                                          ["dense", "snapkv:ratio=0.5"]]
  for group, plan in groups:
    plan = planned.dataclasses.replace(plan, prefill_batch=1)  # SnapKV: 3 sub-batches, joined
    got = decoding.lockstep(model, tokens, starts, group, fused=True,
                            prefill=planned.prefiller(model, plan, opts))
    for k in group:
      assert got[k]["nll"].shape == (3, 8)
      np.testing.assert_allclose(got[k]["nll"], want[k]["nll"], rtol=2e-5, atol=2e-5)
      np.testing.assert_allclose(got[k]["kl"], want[k]["kl"], rtol=1e-4, atol=2e-6)
      np.testing.assert_array_equal(got[k]["agree"], want[k]["agree"])
  # a ragged batch is each row alone
  alone = decoding.lockstep(model, tokens[1:2, :77 + 8], 77, _methods("dense"), fused=False,
                            prefill_chunk=32)
  np.testing.assert_allclose(alone["dense"]["nll"][0], want["dense"]["nll"][1], rtol=2e-5,
                             atol=2e-5)


def test_perplexity_planned_records_equal_the_cpu_loop(tmp_path):
  kw = dict(interval_length=0, ps=())
  program = perplexity.run(_config(perplexity_gpu, **kw), str(tmp_path / "program"))
  cpu = perplexity.run(_config(perplexity_gpu, batch_plan=False, doc_batch=1,
                               decode_step="per_layer", **kw), str(tmp_path / "cpu"))
  assert {r["method"] for r in program} == {"dense", "quest+rect:f=4@0.1", "snapkv@0.5"}
  by_key = {r["key"]: r for r in cpu}
  assert sorted(by_key) == sorted(r["key"] for r in program)  # one record per document
  for r in program:
    c = by_key[r["key"]]
    for f in ("nll", "nll_all", "kl", "agree"):
      assert r[f] == pytest.approx(c[f], rel=2e-5, abs=2e-6), (r["key"], f)
    assert r["decode_step"] == "program" and r["peak_bytes"] is None and r["num_docs"] == 1
    assert r["plan_batch"] == r["rows_run"] == 2 and r["oom_retries"] == 0
  groups = {tuple(r["lockstep"]) for r in program}
  assert groups == {("dense", "quest+rect:f=4@0.1", "snapkv@0.5")}  # lockstep_methods=2
  # the planned fields change how a number is computed, not what it is: one fingerprint
  assert {r["fingerprint"] for r in program} == {r["fingerprint"] for r in cpu}


def test_long_generation_planned_tokens_equal_the_cpu_loop(tmp_path):
  cfg = _config(long_generation_gpu)
  model = modelzoo.tiny_random().in_decode_layout()
  entries = specs.expand(cfg.methods, cfg.budgets, block_size=cfg.block_size)
  prompts = perplexity.documents(model, cfg.text, 160, cfg.num_prompts, cfg.seed)
  progress = lambda *a, **k: None
  progress.update = progress
  with cfg.unlocked():
    cfg.batch_size = 2  # 3 prompts: batches of 2 + 1 (padded to 2)
  gens, forced, probe, extra = long_generation._planned(  # pylint: disable=protected-access
      cfg, model, prompts, entries, progress, None)
  want_gens, want_forced, want_probe = long_generation._together(  # pylint: disable=protected-access
      model, prompts, entries, cfg.new_tokens, progress, None)
  assert gens == want_gens
  for k in want_forced:
    for f in ("nll", "kl"):
      np.testing.assert_allclose(forced[k][f], want_forced[k][f], rtol=1e-4, atol=2e-6)
    np.testing.assert_array_equal(forced[k]["agree"], want_forced[k]["agree"])
  retro = "quest+retro:w=4@0.1"
  assert sorted(probe.row_factors[retro]) == [0, 1, 2]
  for b in range(3):
    np.testing.assert_allclose(probe.row_factors[retro][b], want_probe.row_factors[retro][b],
                               rtol=1e-5)
  assert extra["dense"]["plan_batch"] == 2 and extra["dense"]["decode_step"] == "program"
  assert extra["snapkv@0.5"]["plan_source"] == "override"


def test_a_lockstep_group_holds_every_methods_cache():
  from experiments.tasks import batch_plan
  a = batch_plan.SampleBytes(kept=10, transient=5, split=False, fixed=1)
  b = batch_plan.SampleBytes(kept=20, transient=7, split=True, fixed=2)
  both = batch_plan.combined([a, b])
  assert (both.kept, both.transient, both.split, both.fixed) == (30, 7, False, 3)
  assert batch_plan.combined([b]) is b
  kw = dict(device_bytes=(1 << 30) + 1000, weights_bytes=0, max_batch=100, margin_fraction=0)
  assert batch_plan.choose(both, **kw).batch < batch_plan.choose(a, **kw).batch
