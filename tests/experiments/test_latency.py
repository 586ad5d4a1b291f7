"""experiments/latency.py on the quick configuration: every section runs, outputs are finite."""

import dataclasses
import json
import math
import os

import jax
import numpy as np
import pytest

from configs import latency as latency_config
from experiments import latency_lib, report
from experiments.latency_lib import prefill, settings, timing, traffic
from sparse_attn import methods
from tests import isolated


def test_split_list_keeps_inline_options():
  got = settings.split_list("dense,quest:gqa=group,impl=pallas+resa,topk")
  assert got == ["dense", "quest:gqa=group,impl=pallas+resa", "topk"]


def test_rounds_shuffle_the_order_of_the_candidates():
  order = []
  cands = [timing.Candidate(n, lambda n=n: order.append(n)) for n in "abcd"]
  timing.interleaved(cands, warmup=0, repeats=6)
  rounds = [order[4 + 4 * r: 8 + 4 * r] for r in range(6)]  # after one compile call each
  assert all(sorted(r) == list("abcd") for r in rounds)
  assert len({"".join(r) for r in rounds}) > 1  # not one fixed order
  assert all(len(c.times) == 6 for c in cands)


def test_traffic_bound_is_resa_memory_model():
  m = methods.make("quest:gqa=group+rect:f=32", p=0.1, block_size=16)
  frac = traffic.fraction(m, context=32768, selected_tokens=3276.8, num_q_heads=32,
                          num_kv_heads=8, head_dim=128, itemsize=2)
  assert math.isclose(frac, m.memory_access())  # 1/b + p + 1/f
  head = methods.make("quest:gqa=head", p=0.1)
  assert math.isclose(traffic.fraction(head, context=1000, selected_tokens=100, num_q_heads=32,
                                       num_kv_heads=8, head_dim=128, itemsize=2),
                      1 / 16 + 4 * 0.1)  # per-head selection reads G x the KV


def _quick_run(workdir: str) -> str:
  config = latency_config.get_config()
  config.quick = True  # resolved by settings.resolve (experiments.common.quick)
  return latency_lib.run(config, workdir)


def test_quick_run_writes_finite_results(tmp_path):
  # the benchmark times PyTorch peers: it runs in a child (tests.isolated)
  text = isolated.run(_quick_run, str(tmp_path))
  for name in ("results.jsonl", "latency.md", "latency.png"):
    assert os.path.getsize(tmp_path / name) > 0
  recs = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  sections = {r["section"] for r in recs}
  assert sections == set(settings.SECTIONS) - {"torch_peer"}
  per_layer = [r for r in recs if r["section"] == "per_layer"]
  names = {r["method"] for r in per_layer}
  assert {"dense", "torch SDPA (dense)", "quest:gqa=group,impl=pallas,interpret=true"} <= names
  for r in per_layer:
    assert math.isfinite(r["ms"]) and r["ms"] > 0 and math.isfinite(r["bound"]), r
  for r in recs:
    if r["section"] == "end_to_end":
      assert math.isfinite(r["tok_s"]) and r["tok_s"] > 0, r
    if r["section"] == "memory":
      assert r["cache_bytes"] > 0 and r["peak_rss_mb"] > 0, r
  mem = {r["method"]: r["cache_bytes"] for r in recs if r["section"] == "memory"}
  assert mem["expected_attention:ratio=0.5"] < 0.6 * mem["dense"]
  assert math.isfinite(next(r for r in recs if r["section"] == "resa")["overhead_pct"])
  assert "| dense |" in text and "torch SDPA" in text
  pre = [r for r in recs if r["section"] == "prefill"]
  assert sorted(r["context"] for r in pre) == [64, 128]
  for r in pre:
    assert r["ratio"] > 0 and math.isclose(r["ratio"], r["transformers_s"] / r["ours_s"]), r
  assert "Dense prefill vs transformers" in text

  md = open(report.build(str(tmp_path), str(tmp_path / "report")), encoding="utf-8").read()
  assert "## Decode latency and memory (`results.jsonl`)" in md and "latency.png" in md


def _peer_logits(models_and_ids):
  """transformers' logits of ``prefill.torch_from_params`` per ``(model, ids)`` (in a child)."""
  import torch
  out = []
  for m, ids in models_and_ids:
    with torch.inference_mode():
      out.append(prefill.torch_from_params(m, 1)(input_ids=torch.tensor(ids)).logits.numpy())
  return out


def test_transformers_peer_holds_our_weights():
  """The prefill peer is built from our parameters: same logits (tied and untied heads)."""
  model = prefill.load("tiny-random")
  untied = dict(model.params, lm_head=model.params["embed"].T * 0.5)
  cases = [model, prefill.truncate_layers(model, 1), prefill.dataclasses.replace(
      model, config=model.config.replace(tie_word_embeddings=False), params=untied)]
  ids = np.arange(1, 30)[None]
  host = [dataclasses.replace(m, params=jax.tree.map(np.asarray, m.params)) for m in cases]
  refs = isolated.reference(_peer_logits, [(m, ids) for m in host])
  for m, ref in zip(cases[:2], refs[:2]):
    assert np.abs(np.asarray(m.forward(ids)) - ref).max() <= 1e-4 * np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(cases[2].forward(ids)), refs[2], rtol=1e-4, atol=1e-4)


def test_profile_step_reads_op_times_from_a_trace(tmp_path):
  from experiments import profile_step  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda x: jax.numpy.tanh(x @ x).sum())
  x = jax.numpy.ones((128, 128))
  f(x).block_until_ready()
  jax.profiler.start_trace(str(tmp_path))
  f(x).block_until_ready()
  jax.profiler.stop_trace()
  ops = profile_step.op_times(str(tmp_path))
  assert ops and all(ns >= 0 and n >= 1 for ns, n in ops.values())
  assert not any(k.startswith("ThunkExecutor") for k in ops)


def test_select_sweep_sums_the_kernels_device_time(monkeypatch):
  """decode_sweep.device_us: the ops named like the kernel and all ops, per step (GPU only)."""
  from experiments import decode_sweep, profile_step  # pylint: disable=g-import-not-at-top
  assert decode_sweep.device_us(lambda: None, 4, "block_select") == (None, None)  # a CPU
  ops = {"block_select": (20.0, 1.0), "block_select_1": (1.5, 1.0), "loop_add_fusion": (2.0, 1.0)}
  monkeypatch.setattr(decode_sweep.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(profile_step, "profile", lambda cand, calls, steps: ops)
  assert decode_sweep.device_us(lambda: None, 4, "block_select") == (21.5, 23.5)
  assert decode_sweep.device_us(lambda: None, 4, "sparse_decode") == (None, 23.5)


def test_mosaic_sweep_rows(monkeypatch):
  """decode_sweep --mosaic: dense lists every block, the sparse list keeps ``keep`` of them in
  id order (distinct, per kv head); a row's bound is the bytes its list must read at the peak,
  and a body name other than mma / rows is an error."""
  import io  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from experiments import decode_sweep  # pylint: disable=g-import-not-at-top
  lists = decode_sweep.mosaic_lists(100, 3, 0.1)
  assert set(lists) == {"identity", "dense", "keep 0.1"} and lists["identity"] is None
  np.testing.assert_array_equal(lists["dense"][0, 2], np.arange(100))
  sparse = np.asarray(lists["keep 0.1"])
  assert sparse.shape == (1, 3, 10)
  for row in sparse[0]:
    assert (np.diff(row) > 0).all() and row.min() >= 0 and row.max() < 100
  assert set(decode_sweep.mosaic_lists(100, 3, 0.0)) == {"identity", "dense"}

  flags = types.SimpleNamespace(mosaic="mma,rows", mosaic_tokens="64", mosaic_stages="3",
                                mosaic_keep=0.0, peak_tbs=4.0, interpret=False, repeats=1,
                                dtype="bfloat16", steps=2)
  monkeypatch.setattr(decode_sweep, "FLAGS", flags)
  monkeypatch.setattr(decode_sweep, "_provenance", dict)
  monkeypatch.setattr(decode_sweep, "mosaic_step", lambda b, idx, steps, interp, **kw: kw)
  monkeypatch.setattr(decode_sweep, "median_step_us", lambda fn, steps, repeats: (1.0, 50.0))
  s = types.SimpleNamespace(block_size=16, num_kv_heads=8, head_dim=128)
  bench = types.SimpleNamespace(s=s, context=4096, dtype=jax.numpy.bfloat16)
  out = io.StringIO()
  decode_sweep.mosaic_sweep(out, bench, {"torch SDPA": 100.0}, 2)
  rows = [json.loads(line) for line in out.getvalue().splitlines()]
  assert [(r["list"], r["body"]) for r in rows] == [
      ("identity", "mma"), ("identity", "rows"), ("dense", "mma"), ("dense", "rows")]
  moved = 2 * 8 * 4096 * 128 * 2  # K and V of every block, bf16
  assert rows[0]["bytes"] == rows[2]["bytes"] == moved
  assert abs(rows[0]["peak_fraction"] - moved / 4e12 * 1e6 / 50.0) < 1e-9
  flags.mosaic = "wgmma"
  with pytest.raises(ValueError, match="mma and rows"):
    decode_sweep.mosaic_sweep(out, bench, {}, 2)


def test_sweep_grid_scales_the_split_count(monkeypatch):
  """decode_sweep's grid: 0 is the default split count (None), other multiples scale it from the
  list's length (fractions round, at least 1), crossed with iterations / stages and warps."""
  import types  # pylint: disable=g-import-not-at-top
  from experiments import decode_sweep  # pylint: disable=g-import-not-at-top
  from pallas_kernels import _common  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(decode_sweep, "FLAGS", types.SimpleNamespace(
      splits="0,0.5,2", iters="0/3,8/3", warps="4"))
  base = _common.choose_num_splits(8, 819)
  rows = decode_sweep.grid(819, 8)
  assert len(rows) == 6 and {r["num_warps"] for r in rows} == {4}
  assert [r["num_splits"] for r in rows[::2]] == [None, max(1, round(base / 2)), 2 * base]
  assert [(r["blocks_per_iter"], r["num_stages"]) for r in rows[:2]] == [(None, 3), (8, 3)]
