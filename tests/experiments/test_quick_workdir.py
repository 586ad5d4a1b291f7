"""``--config.quick=True`` writes to its own workdir: the docstring's command works on a clone
whose ``results/NAME`` holds the committed records of the full config."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from experiments.common import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _docstring_quick_command(name: str) -> list[str]:
  """The ``--config.quick=True`` line of ``configs/NAME.py``'s docstring, as argv."""
  with open(os.path.join(ROOT, "configs", f"{name}.py"), encoding="utf-8") as f:
    line = next(ln for ln in f if "--config.quick=True" in ln)
  return re.sub(r"\s+#.*$", "", line).split()


@pytest.mark.slow  # one quick accuracy run on tiny-random, ~30 s on 2 cores
def test_accuracy_docstring_quick_command_beside_committed_results(tmp_path):
  cmd = _docstring_quick_command("accuracy")
  assert cmd[:3] == ["python", "-m", "experiments.accuracy"] and "--workdir" not in " ".join(cmd)
  os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
  committed = tmp_path / "results" / "accuracy" / "results.jsonl"
  committed.parent.mkdir(parents=True)
  with open(os.path.join(ROOT, "results", "accuracy", "results.jsonl"), "rb") as src:
    committed.write_bytes(src.readline())  # one record of the full config is enough
  before = committed.read_bytes()
  proc = subprocess.run([sys.executable, *cmd[1:]], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "tiny random model" in proc.stderr and "results_quick/accuracy" in proc.stderr
  assert (tmp_path / "results_quick" / "accuracy" / "results.jsonl").stat().st_size > 0
  assert committed.read_bytes() == before
  written = (tmp_path / "results_quick" / "accuracy" / "accuracy.md").read_text()
  assert written.startswith("# ") and "scores are meaningless by design" in written.split("\n")[2]
  assert "scores are meaningless by design" in proc.stdout  # the markdown the run prints


def test_quick_markdown_says_its_scores_are_meaningless_once(tmp_path):
  path = tmp_path / "x.md"
  path.write_text("# Title\n\n| a |\n|---|\n| 1 |\n")
  cli.mark_quick(str(path))
  cli.mark_quick(str(path))
  lines = path.read_text().split("\n")
  assert lines[0] == "# Title" and lines[2].startswith("> **Quick mode (--config.quick=True)")
  assert path.read_text().count("meaningless") == 1 and lines[4] == "| a |"
