"""The GPU benchmark's quick mode (configs/latency_gpu.py on the CPU) and its byte model."""

import importlib.util
import json
import math

import jax
import pytest

from configs import latency_gpu
from experiments import latency_lib
from experiments.latency_lib import settings, shape_e2e, shape_ours, shapes
from sparse_attn import methods
from tests import isolated


def _quick_settings(**kw):
  values = latency_gpu.get_config(quick=True).to_dict()
  values.update(kw)
  return settings.Settings(values)


def test_weight_bytes_are_the_bytes_of_the_random_model():
  config = shapes.model_config("tiny", "float32")
  model = shapes.random_model(config)
  leaves = jax.tree.leaves(model.params)
  got = shapes.weight_bytes(config, batch=3)
  assert got["layers"] + got["head"] == sum(x.nbytes for x in leaves) - model.params["embed"].nbytes
  assert got["embed_rows"] == 3 * config.hidden_size * 4
  assert isinstance(model.params["layers"], list) and len(model.params["layers"]) == 2


def test_llama_8b_bytes_per_step():
  """15.0 GB of weights a step reads (the embedding table is looked up, not read) and 4.29 GB
  of bf16 KV at 32k: the 4.0 ms bound of issue 36 at 4.8 TB/s."""
  config = shapes.model_config("llama-3.1-8b", "bfloat16")
  assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
      32, 32, 8, 128)
  w = shapes.weight_bytes(config)["total"]
  kv = shapes.kv_bytes(methods.make("dense"), config, context=32768, batch=1)
  assert abs(w / 1e9 - 15.01) < 0.01 and kv == 2 * 32 * 8 * 32768 * 128 * 2
  quest = shapes.kv_bytes(methods.make("quest:gqa=group", p=0.1), config, context=32768,
                          batch=1)
  assert math.isclose(quest / kv, 1 / 16 + 0.1, rel_tol=1e-3)
  # two of the 32 layers dense (Quest's own evaluation) read dense's bytes
  two = shapes.kv_bytes(methods.make("quest:gqa=group,dense_layers=2", p=0.1), config,
                        context=32768, batch=1)
  assert math.isclose(two / kv, (2 + 30 * quest / kv) / 32, rel_tol=1e-9)
  b = shapes.bound(5e-3, w, kv, 4800.0)
  assert math.isclose(b["bound_ms"], (w + kv) / 4.8e9) and 0 < b["bound_fraction"] <= 1
  assert b["bound_flag"] is None
  assert shapes.bound(1e-6, w, kv, 4800.0)["bound_flag"].startswith("faster than the bound")
  assert shapes.bound(5e-3, w, kv, 0.0)["bound_fraction"] is None


def test_grid_names_every_part_once():
  s = _quick_settings()
  g = shape_e2e.grid(s)
  keys = [p["part"] for ps in g.values() for p in ps]
  assert len(keys) == len(set(keys))
  ours = g["ours"]
  assert {p["method"] for p in ours if p["phase"] == "decode"} == set(
      settings.split_list(s.shape_methods))
  assert {(p["phase"], p["batch"]) for p in g["transformers"]} == {
      ("prefill", 1), ("decode", 1), ("decode", 2)}


def test_memory_check_skips_what_does_not_fit():
  assert shape_ours.fits(1 << 20) is None
  assert shape_ours.fits(1 << 62).startswith("memory: needs")


def test_a_part_that_times_out_is_recorded_not_dropped(tmp_path):
  s = _quick_settings(shape_part_timeout_s=0.05)  # the child cannot even build the model
  got = []
  parts = shape_e2e.grid(s)["ours"][:2]
  shape_e2e._run_engine("ours", s, parts, str(tmp_path / "log"),  # pylint: disable=protected-access
                        lambda rec, key: got.append((rec, key)))
  assert [r["part"] for r, _ in got] == [p["part"] for p in parts]
  assert all(r["status"] == "timeout" and key is None for r, key in got)  # retried on a rerun


def _quick_run(workdir: str) -> str:
  return latency_lib.run(latency_gpu.get_config(quick=True), workdir)


def test_quick_run_of_the_gpu_benchmark(tmp_path):
  text = isolated.run(_quick_run, str(tmp_path))
  recs = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
  rows = [r for r in recs if r.get("section") == "shape_e2e"]
  s = _quick_settings()
  want = {p["part"] for ps in shape_e2e.grid(s).values() for p in ps}
  assert {r["part"] for r in rows} == want  # every part has a record
  for r in rows:
    assert r["status"] == "ok", r
    for field in ("engine", "phase", "batch", "context", "method", "backend", "device",
                  "peak_gbs", "peak_source", "tok_s"):
      assert field in r, (field, r)
    if r["phase"] == "decode":
      assert r["step_ms"] > 0 and r["weight_bytes"] > 0 and r["kv_bytes"] > 0, r
      if r["engine"] == "ours":  # the issue time of a round's first steps, below PJRT's queue
        assert r["dispatch_steps"] == min(r["steps"], shape_ours.ISSUE_PROBE_STEPS) < 32, r
        assert 0 < r["dispatch_ms"], r
      frac = r["bound_fraction"]
      assert (frac is not None and 0 < frac <= 1) or r["bound_flag"], r
    else:
      assert r["seconds"] > 0, r
  kv = {r["method"]: r["kv_bytes"] for r in rows
        if r["phase"] == "decode" and r["batch"] == 1 and r["engine"] == "ours"}
  c = shapes.model_config("tiny", "float32")
  assert kv["dense"] == 2 * c.num_layers * c.num_kv_heads * 128 * c.head_dim * 4
  assert kv["quest:gqa=group+resa"] > kv["dense"]  # at 128 tokens n_min = 16 blocks is all
  has_torch = importlib.util.find_spec("torch") is not None
  peers = [r for r in rows if r["engine"] == "transformers"]
  assert bool(peers) == has_torch
  layer = {r["method"] for r in recs if r.get("section") == "per_layer"}
  assert {"dense", "quest:gqa=group"} <= layer
  assert ("torch SDPA (dense)" in layer) == has_torch
  chunk = [r for r in recs if r.get("section") == "prefill_chunk"]  # kernel vs in-order
  assert sorted((r["where"], r["method"].split(" ")[0]) for r in chunk) == [
      ("first", "chunk"), ("first", "in-order"), ("last", "chunk"), ("last", "in-order")]
  assert all(r["ms"] > 0 and r["tflops"] > 0 for r in chunk)
  assert "End to end, named shape (random weights) vs transformers" in text
  assert "| decode | 1 | 128 | dense | ok |" in text and "transformers" in text
  assert "* |" not in text  # no host time read over a whole round


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_every_shape_reads_as_a_model_config(name):
  c = shapes.model_config(name, "bfloat16")
  family = name.split("-")[0]
  assert c.rope.rope_type == {"qwen3": "default", "gemma": "linear", "r1": "default"}.get(
      family, "llama3")
  assert c.num_heads % c.num_kv_heads == 0 and c.qk_norm == (family in ("qwen3", "gemma"))
  if name == "gemma-3-12b":
    assert c.sliding_layers == ((True,) * 5 + (False,)) * 8 and c.sliding_window == 1024
    assert c.rope_of(True).theta == 1e4 and c.rope.factor == 8.0 and c.tie_word_embeddings


def test_report_keeps_every_part_and_prefers_a_finished_record():
  from experiments.latency_lib import report  # pylint: disable=g-import-not-at-top
  base = dict(section="shape_e2e", shape="llama-3.1-8b", dtype="bfloat16", phase="decode",
              context=131072, engine="ours", device="NVIDIA H200", backend="gpu",
              peak_gbs=4800.0, peak_source="data sheet (H200)")
  recs = [
      dict(base, part="a", batch=1, method="dense", status="timeout", reason="exceeded"),
      dict(base, part="a", batch=1, method="dense", status="ok", step_ms=40.0, tok_s=25.0,
           weight_bytes=15e9, kv_bytes=17e9, bound_ms=6.7, bound_fraction=0.17),
      dict(base, part="b", batch=8, method="dense", status="skipped", weight_bytes=15e9,
           kv_bytes=137e9, reason="memory: needs ~140 GiB"),
      dict(base, part="c", batch=1, method="transformers", engine="transformers",
           status="error", reason="child exited with code -9"),
      dict(section="shape_e2e", shape="llama-3.1-8b", dtype="bfloat16", phase="decode",
           context=32768, engine="ours", part="d", batch=1, method="dense", status="timeout",
           reason="the run's deadline"),
  ]
  assert [r["status"] for r in report.shape_rows(recs)] == ["ok", "skipped", "error", "timeout"]
  text = report.shape_table(recs)
  assert "| decode | 1 | 131072 | dense | ok | 40 |" in text and "0.17" in text
  assert "memory: needs ~140 GiB" in text and "child exited" in text
  assert "on NVIDIA H200 (gpu), peak 4.8e+03 GB/s" in text
  assert " on None" not in text  # the timed-out row, which names no device, adds no heading
  assert "dense decode, fraction of the bound, 131072" in report.shape_targets(recs)
