"""``experiments.compaction_bench`` runs end to end and prints what it promises (tiny model)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_prints_cache_ratio_and_question_read_ratio():
  args = [sys.executable, "-m", "experiments.compaction_bench", "--model=tiny-random",
          "--spec=snapkv", "--context=96", "--question_tokens=8"]
  proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  ratio = float(re.search(r"MiB = ([0-9.]+);", out).group(1))
  assert 0.4 < ratio < 0.7, out  # half the prompt evicted, within a block of rounding
  assert len(re.findall(r"question of 8 tokens, (chunk|stepwise) second", out)) == 2, out
  assert re.search(r"stepwise / chunk = [0-9.]+x", out), out
