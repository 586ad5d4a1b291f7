"""experiments.compression_time: its candidate compresses the prefilled prompt as
``models.decode.prefill`` does (``run_prompt`` then ``end_prefill``), and the script prints
each method's time and ratio and writes its rows."""

import json
import subprocess
import sys

import numpy as np

from experiments import compression_time
from experiments.common import modelzoo
from models import decode
from sparse_attn import methods


def test_candidate_is_the_prefills_compression():
  model = modelzoo.tiny_random()
  cand = compression_time.end_of_prompt(model, "chunkkv:window_size=8,reuse_layers=2", 0.5,
                                        96, seed=1)
  caches, _ = cand.fn()
  prompts = np.random.default_rng(1).integers(10, model.config.vocab_size - 10,
                                              (1, 96)).astype(np.int32)
  m = methods.make("chunkkv:window_size=8,reuse_layers=2", ratio=0.5)
  *_, want, _ = decode.prefill(model, prompts, np.array([96], np.int32), m, 96 + 16)
  for got, ref in zip(caches, want):
    np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(ref.pos))
    assert int(np.asarray(got.valid).sum()) == 2 * 48  # 2 kv heads x ceil(96 / 2)


def test_script_prints_ratios_and_writes_rows(tmp_path):
  out = tmp_path / "rows.jsonl"
  run = subprocess.run(
      [sys.executable, "-m", "experiments.compression_time", "--model=tiny-random",
       "--length=64", "--repeats=2", "--methods=snapkv:window_size=8,knorm", f"--out={out}"],
      capture_output=True, text=True, check=True)
  assert "x1.000 of snapkv:window_size=8" in run.stdout
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert [r["method"] for r in rows] == ["snapkv:window_size=8", "knorm"]
  assert all(r["ms"] > 0 and len(r["times_s"]) == 2 for r in rows)
