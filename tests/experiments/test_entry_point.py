"""``python -m experiments NAME``: the one form for every experiment and tool the README names."""

import importlib
import os
import re
import subprocess
import sys

from experiments import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = importlib.import_module("experiments.__main__").TOOLS


def _readme_names() -> set[str]:
  """Names in the README's experiment table and in its ``python -m experiments...`` commands."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  table = text[text.index("| experiment | what |"):]
  table = table[:table.index("\n\n")]
  names = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
  return names | set(re.findall(r"python -m experiments[. ]([a-z_]+)", text))


def test_every_name_the_readme_lists_is_one_entry_point():
  names = _readme_names()
  assert {"generate", "report", "reproduce", "claims", "accuracy", "merge"} <= names
  assert names <= set(registry.by_name()) | set(TOOLS), names - set(registry.by_name())


def test_tools_run_under_python_m_experiments():
  cases = [  # (args, exit status, text in stderr or stdout)
      (["generate", "--method=qeust"], 1, "generate: error: unknown method 'qeust'"),
      (["report", "--helpshort"], 1, "experiments.report --workdir=results"),  # absl: help, 1
      (["reproduce", "--helpshort"], 1, "experiments.reproduce --workdir=results"),
      (["claims", "--workdir=/nonexistent"], 1, "--workdir=/nonexistent is not a directory"),
      (["nosuch"], 2, "unknown experiment 'nosuch'"),
      ([], 2, "generate "),  # the usage lists the tools beside the experiments
  ]
  procs = [subprocess.Popen([sys.executable, "-m", "experiments", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for args, _, _ in cases]
  for (args, status, expected), proc in zip(cases, procs):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == status and expected in out + err, (args, out[-1000:], err[-1000:])
    assert "Traceback" not in err, (args, err[-2000:])


def test_every_experiments_module_imports_beside_the_others():
  """All of experiments/ imported into one process (as pytest workers and notebooks do): a
  flag two scripts define at import time (absl's DuplicateFlagError) fails here."""
  code = ("import pkgutil, importlib, experiments\n"
          "for m in pkgutil.walk_packages(experiments.__path__, 'experiments.'):\n"
          "  if not m.name.endswith('__main__'):\n"
          "    importlib.import_module(m.name)\n")
  run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
