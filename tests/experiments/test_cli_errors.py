"""Every CLI answers a user error with one line on stderr and a non-zero exit, no traceback.

The scripts run as real subprocesses (absl flag parsing, ``cli.run``), all at once. Each fails
in its checks before a model loads (a too-long run right after the model loads, before any
sample is built); bad models fail before JAX is even imported.
"""

import os
import subprocess
import sys
import time

from experiments.common import config_check, quick

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (script, flags, text the error line must contain)
CASES = [
    ("generate", ["--method=qeust"], "unknown method 'qeust'; valid:"),  # no block_size=16
    ("generate", ["--budget=0"], "--budget=0.0 is not a budget"),
    ("generate", ["--model=/nonexistent"], "model '/nonexistent' is neither a known name"),
    ("generate", ["--max_new_tokens=many"], "--max_new_tokens=many"),
    ("generate", ["--budget=1.5"],
     "--budget=1.5 is not a budget: a fractional budget must be in (0, 1], got 1.5"),
]
for _script, _specs, _budgets in (("accuracy", "methods", "budgets"),
                                  ("perplexity", "methods", "budgets"),
                                  ("attention_error", "selectors", "budgets")):
  CASES += [
      (_script, [f"--config.{_specs}=qeust"], f"--config.{_specs}: unknown method 'qeust'"),
      (_script, [f"--config.{_budgets}=0"], f"--config.{_budgets}=0 is not a budget"),
      (_script, ["--config.model=/nonexistent"], "model '/nonexistent' is neither a known name"),
  ]
CASES += [
    ("accuracy", ["--config.num_samples=abc"], "--config.num_samples=abc"),
    ("resa_lambda", ["--config.method=quest:bogus=1"], "unknown option(s) ['bogus']"),
    ("accuracy", ["--config=/nonexistent.py"], "/nonexistent.py"),
    ("accuracy", ["--config=configs/nope.py"], "--config=configs/nope.py: no such config file"),
    ("accuracy", ["--config.budgets=1.5"], "a fractional budget must be in (0, 1], got 1.5"),
    ("accuracy", ["--config.model=tiny-random", "--config.lengths=100000",
                  "--config.max_new_tokens=64"],
     "prompt 100000 + 64 new tokens = 100064 positions exceed the model's "
     "max_position_embeddings 2048; pass --allow_long_context"),
    ("perplexity", ["--mesh=rows:2"], "bad mesh entry 'rows:2'"),
    ("long_generation", ["--mesh=data:64"], "needs 64 devices, 1 available"),
]


def test_user_errors_are_one_line_without_traceback(tmp_path):
  procs = []
  for i, (script, flags, _) in enumerate(CASES):
    args = [sys.executable, "-m", f"experiments.{script}", *flags]
    if script != "generate":
      args.append(f"--workdir={tmp_path / str(i)}")
    procs.append(subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  for (script, flags, expected), proc in zip(CASES, procs):
    out, err = proc.communicate(timeout=600)
    what = f"{script} {' '.join(flags)}:\n{err[-2000:]}"
    assert proc.returncode == 1, what
    assert "Traceback" not in err and not out.strip(), what
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), what
    assert expected in lines[0], what
  assert not any((tmp_path / str(i)).exists() for i in range(len(CASES)))  # nothing written


# Config mistakes, without --config.quick (the default model needs the qwen extra): each is one
# line naming the field and what it accepts, before JAX is imported (a stand-in jax that
# refuses to import is first on the path), so before any model or data loads.
CONFIG_CASES = [
    (["--config.nosuchkey=3"], "--config.nosuchkey: configs/accuracy.py has no field "
     "'nosuchkey'; its fields: batch_size, block_size, bucket_capacity, budgets,"),
    (["--config=configs/accuracy.py", "--config.lenghts=5"],
     "--config.lenghts: configs/accuracy.py has no field 'lenghts' (did you mean lengths?)"),
    (["--config.lengths=(abc,)"],
     "--config.lengths=(abc,): expects a tuple of positive integers (default: 4096,8192)"),
    (["--config.lengths=(-5,)"], "--config.lengths=-5: expects a tuple of positive integers"),
    (["--config.num_samples=0"], "--config.num_samples=0: expects a positive integer"),
    (["--config.depths=(abc,)"], "--config.depths=(abc,): expects a tuple of non-negative"),
    (["--config.tasks=niah_single_9"], "--config.tasks=niah_single_9: expects a tuple of names "
     "among passkey, niah_single_1,"),
    (["--config.protocol=aware"], "--config.protocol=aware: expects one of query_aware, "
     "query_agnostic"),
    (["--config.haystack=essay"], "--config.haystack=essay: expects one of austen, essays,"),
]


def test_config_errors_are_one_line_before_jax_loads(tmp_path):
  (tmp_path / "jax").mkdir()
  (tmp_path / "jax" / "__init__.py").write_text(
      "raise ImportError('jax imported before the config was checked')\n")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
  for flags, expected in CONFIG_CASES:
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "experiments.accuracy", *flags,
                          f"--workdir={tmp_path / 'w'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    seconds = time.perf_counter() - start
    what = f"{' '.join(flags)}:\n{run.stderr[-2000:]}"
    assert run.returncode == 1 and not run.stdout.strip(), what
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"accuracy: error: {expected}"), what
    assert seconds < 5, (seconds, what)  # ~0.2 s alone; JAX alone takes longer to import
  assert not (tmp_path / "w").exists()


def test_every_config_passes_its_own_checks():
  for name in sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                     if f.endswith(".py") and not f.startswith("_")):
    get_config = quick.module_get_config(name)
    for is_quick in (False, True):
      config_check.check(get_config(is_quick), get_config)
