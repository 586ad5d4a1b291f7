"""configs/latency_gpu_claims.py on the CPU (tiny shapes), its tree-hash provenance, and the
claim rows of Retro Table 6 and ReSA Fig. 6 / 7 on synthetic records."""

import json
import os

import pytest

from experiments.claims import speed, speed_e2e
from experiments.common import provenance, results
from tests import isolated


def _manifest(tmp_path, change: str | None = None) -> tuple[str, str]:
  """A manifest of the files on disk (optionally with one file's hash wrong) and its hash."""
  m = provenance.manifest_from_disk(revision="0" * 40)
  if change:
    m["files"][change] = "f" * 40
  path = tmp_path / "manifest.json"
  path.write_text(json.dumps(m))
  return str(path), provenance.tree_hash(m)


def _env(manifest: str, tree: str, **extra) -> dict:
  return dict(EXPERIMENT_REVISION="0" * 40, EXPERIMENT_TREE_HASH=tree,
              EXPERIMENT_MANIFEST=manifest, EXPERIMENT_SESSION="s1", **extra)


def _quick_run(workdir: str, env: dict) -> list:
  os.environ.update(env)
  from configs import latency_gpu_claims  # pylint: disable=g-import-not-at-top
  from experiments import latency_lib  # pylint: disable=g-import-not-at-top
  latency_lib.run(latency_gpu_claims.get_config(quick=True), workdir)
  return results.read_records(os.path.join(workdir, "results.jsonl"))


def test_quick_plan_end_to_end_verified(tmp_path):
  manifest, tree = _manifest(tmp_path)
  recs = isolated.run(_quick_run, str(tmp_path / "w"), _env(manifest, tree), timeout=600)
  items = {r["item"] for r in recs}
  assert items == {"retro@64x1", "batch@64x2", "resa_e2e@64", "resa_kernels@64"}
  assert all(r["status"] == "ok" and r["git_verified"] and r["session"] == "s1" for r in recs)
  assert all(r["git"] == "0" * 40 and r["tree_hash"] == tree for r in recs)
  kern = next(r for r in recs if r["section"] == "resa_kernels")
  assert min(kern[k] for k in ("estimation_ms", "attention_ms", "rectification_ms")) > 0
  assert speed_e2e.retro_table6(recs) is not None and speed_e2e.resa_fig6(recs) is not None
  assert speed_e2e.resa_fig7(recs).verdict == "not comparable"  # tiny, not Qwen-3 1.7B


def _write(tmp_path, env, monkeypatch):
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  provenance._state.cache_clear()  # pylint: disable=protected-access
  w = results.ResultWriter(str(tmp_path / "w"), {"a": 1}, "latency")
  return w.write({"x": 1})


def test_a_changed_imported_file_is_refused_or_unverified(tmp_path, monkeypatch):
  manifest, tree = _manifest(tmp_path, change="experiments/common/results.py")
  with pytest.raises(provenance.UnverifiedTree, match="results.py"):
    _write(tmp_path, _env(manifest, tree), monkeypatch)
  rec = _write(tmp_path, _env(manifest, tree, EXPERIMENT_ALLOW_UNVERIFIED="1"), monkeypatch)
  assert rec["git"].endswith("+unverified") and rec["git_verified"] is False
  from experiments.claims import verdicts  # pylint: disable=g-import-not-at-top
  assert verdicts.is_unverified(rec) and not verdicts.is_declared(rec)
  _manifest(tmp_path)  # rewritten: the declared hash is no longer the manifest's (stale)
  with pytest.raises(provenance.UnverifiedTree, match="stale manifest"):
    _write(tmp_path, _env(manifest, tree, EXPERIMENT_ALLOW_UNVERIFIED="0"), monkeypatch)
  provenance._state.cache_clear()  # pylint: disable=protected-access


def _e2e(item, method, ms, session="s1", **kw):
  ctx, _, b = item.split("@")[1].partition("x")
  base = dict(section="shape_e2e", study=item.split("@")[0].split(":")[0], item=item,
              item_parts=kw.pop("parts", 2), context=int(ctx), batch=int(b or 1),
              method=method, status="ok", session=session, time="t", device="H100", git="abc",
              steps=256, times_ms=list(ms), step_ms=sum(ms) / len(ms),
              machine={"backend": "gpu"})
  base.update(kw, part=f"{item}/{method}")
  return base


def test_claim_rows_from_synthetic_records():
  q = "quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside"
  recs = [_e2e("retro@32768x8", q, [10, 10, 10, 10]),
          _e2e("retro@32768x8", q + "+retro:w=8", [10.5, 10.5, 10.6, 10.4]),
          _e2e("retro@32768x1", q, [5, 5], session="s2"),  # incomplete: never paired
          _e2e("retro@32768x1", q + "+retro:w=8", [9, 9], session="s3")]
  row = speed.retro_throughput_loss_gpu(recs)
  assert row.verdict == "reproduced" and "32k b8: w8 +4.8%" in row.ours, row
  assert "paper 7.3%" in row.ours and "32k b1" in row.why  # not measured yet
  w = dict(weight_bytes=1.0, kv_bytes=9.0)
  fig7 = [_e2e("resa_e2e:qwen3-1.7b@262144", "dense", [30, 30, 31], shape="qwen3-1.7b", **w),
          _e2e("resa_e2e:qwen3-1.7b@262144", "rectified", [9, 9, 9], shape="qwen3-1.7b",
               weight_bytes=1.0, kv_bytes=1.75)]
  row = speed_e2e.resa_fig7(fig7)
  assert row.verdict == "reproduced" and "3.37x" in row.ours, row
  kern = [dict(section="resa_kernels", study="resa_kernels", item=f"resa_kernels@{c}",
               item_parts=1, part=f"k{c}", status="ok", session="s1", time="t", context=c,
               shape="r1-distill-qwen-7b", method="rectified", estimation_ms=0.02,
               attention_ms=0.02, rectification_ms=rect, dense_ms=0.5, sparse_total_ms=0.06,
               heads=[28, 4, 128], times_ms={"step": [1, 1]}) for c, rect in
          ((65536, 0.008), (262144, 0.3))]
  row = speed_e2e.resa_fig6(kern)
  assert row.verdict == "not reproduced" and "rect 16.7%" in row.ours, row


def test_retro_row_takes_a_cut_short_session_and_names_what_it_lacks():
  """A lease that ran out of time mid-item: its finished windows are a row (paired within the
  session), the windows it did not reach are named; a complete later session wins."""
  q = "quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside"
  cut = [_e2e("retro@32768x8", q, [10, 10], parts=4),
         _e2e("retro@32768x8", q + "+retro:w=8", [12.5, 12.5], parts=4),
         _e2e("retro@32768x8", q + "+retro:w=2", [99, 99], parts=4, status="timeout")]
  row = speed.retro_throughput_loss_gpu(cut)
  assert "32k b8: w8 +20.0%" in row.ours and "not finished: w2, w4" in row.ours, row
  assert row.verdict == "not reproduced" and len(row.read) == 2  # the timeout is no part
  whole = [_e2e("retro@32768x8", q, [10, 10], parts=2, session="s9", time="u"),
           _e2e("retro@32768x8", q + "+retro:w=8", [10.2, 10.2], parts=2, session="s9",
                time="u")]
  row = speed.retro_throughput_loss_gpu(cut + whole)
  assert "w8 +2.0%" in row.ours and "not finished: w2, w4" in row.ours, row


def test_gpu_overhead_row_names_the_device_of_the_run_it_read():
  """Per-layer GPU rows pair rounds within the latest run and name that run's device, not the
  first GPU record's (an H100 run followed by an H200 one)."""
  def rec(run, device, method, ms, time):
    return dict(section="per_layer", dtype="bfloat16", context=8192, method=method, run=run,
                device=device, time=time, times_ms=[ms] * 4, machine={"backend": "gpu"})
  base, resa = "quest:gqa=group,budget=500", "quest:gqa=group,budget=500+resa"
  recs = [rec("a", "H100", base, 1.0, "1"), rec("a", "H100", resa, 2.0, "1"),
          rec("b", "H200", base, 1.0, "2"), rec("b", "H200", resa, 1.5, "2"),
          rec("c", "H100", base, 1.0, "3")]  # a later run without the pair: not read
  row = speed.resa_decode_overhead_gpu(recs)
  assert "8k +50.0% [+50.0, +50.0] (+500 us)" in row.ours and "H200, Pallas" in row.setting, row
  assert "H100" not in row.setting and {r["run"] for r in row.read} == {"b"}


def test_report_names_the_gpu_of_each_folder():
  from experiments.claims import report  # pylint: disable=g-import-not-at-top
  gpu = lambda dev: dict(device=dev, machine={"backend": "gpu"})
  files = {"/r/a/results.jsonl": [gpu("H100"), dict(machine={"backend": "gpu"})],
           "/r/b/c/results.jsonl": [gpu("H200"), gpu("H100")],
           "/r/d/results.jsonl": [dict(device="cpu", machine={"backend": "cpu"})]}
  assert report.gpu_folders(files, "/r") == {"H100": ["a", "b/c"], "H200": ["b/c"]}
