"""``experiments.ruler_throughput`` (issue 55's GPU measurement) on a CPU: its quick path end to
end (an ``ours`` part in its own process, the summary), the summary's rates and goals on
hand-made records, and the kvpress presses it builds (kvpress is not installed in CI: a stand-in
module checks the mapping; ``experiments/ruler_gpu.sh`` carries the real one to the GPU)."""

import json
import os
import subprocess
import sys
import types

from experiments import ruler_throughput as rt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_end_to_end(tmp_path):
  out = tmp_path / "out"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.ruler_throughput", "--quick", f"--out={out}",
       "--samples=1", "--parts=ours:snapkv@0.5,kvpress:nosuch@0.5"],
      cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  parts = [json.loads(l) for l in open(out / "parts.jsonl")]
  assert [(p["part"], p["rc"]) for p in parts][0] == ("ours:snapkv@0.5", 0)
  assert parts[1]["rc"] != 0  # a kvpress part that cannot run is reported, the run goes on
  recs = [json.loads(l) for l in open(out / "ours" / "results.jsonl")]
  assert len(recs) == 2 and {r["task"] for r in recs} == {"niah_single_1", "qa"}
  assert {r["decode_step"] for r in recs} == {"program"}  # quick forces the GPU's step
  assert all(r["plan_batch"] == 2 and r["model"] == "tiny-random" for r in recs)
  md = open(out / "ruler_throughput.md").read()
  assert "| ours | snapkv@0.5 | 2 | 2 |" in md and "not measured in these folders" in md
  assert os.listdir(out / "samples")  # the prompts were kept for the next part


def _ours(method, batch, seconds, index, plan_batch):
  return dict(experiment="accuracy", run="r1", method=method, length=32768, batch_index=index,
              batch_seconds=seconds, batch_size=batch, rows_run=batch, plan_batch=plan_batch,
              plan_prefill_batch=1, plan_bytes=70 << 30, peak_bytes=60 << 30)


def test_summary_rates_and_goals(tmp_path):
  d = tmp_path / "gpu"
  os.makedirs(d / "ours")
  recs = ([_ours("dense", 7, 70.0, 0, 12)] * 7 + [_ours("dense", 7, 14.0, 1, 12)] * 7
          + [_ours("expected-attention@0.5", 14, 36.0, 0, 24)] * 14)
  with open(d / "ours" / "results.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in recs)
  with open(d / "kvpress.jsonl", "w") as f:
    for _ in range(7):
      f.write(json.dumps(dict(side="kvpress", method="expected-attention@0.5", seconds=9.0,
                              peak_bytes=30 << 30, device_name="NVIDIA H100")) + "\n")
  rows = {(r["side"], r["method"]): r for r in rt.rows([str(d)])}
  dense = rows[("ours", "dense")]
  assert dense["samples"] == 14 and dense["seconds"] == 84.0  # one wall time per batch
  assert dense["per_hour"] == 600.0 and dense["warm_per_hour"] == 1800.0
  ea, theirs = rows[("ours", "expected-attention@0.5")], rows[("kvpress", "expected-attention@0.5")]
  assert ea["per_hour"] == 1400.0 and theirs["per_hour"] == 400.0 and ea["vs_kvpress"] == 3.5
  text = rt.summary([str(d)])
  assert "# RULER throughput (NVIDIA H100)" in text
  assert "3.50x (not met)" in text and "batch 24 vs dense 12 (larger)" in text


def test_kvpress_presses_for_our_specs():
  fake = types.SimpleNamespace(
      AdaKVPress=lambda press: ("adakv", press),
      ExpectedAttentionPress=lambda **kw: ("ea", kw),
      SnapKVPress=lambda **kw: ("snapkv", kw))
  assert rt.press_of(fake, "dense") is None
  assert rt.press_of(fake, "expected-attention@0.5") == (
      "adakv", ("ea", dict(compression_ratio=0.5, epsilon=0.01)))
  assert rt.press_of(fake, "snapkv@0.25") == ("snapkv", dict(compression_ratio=0.75))
