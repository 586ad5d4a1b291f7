"""Sharding: mesh parsing and layout tables here; the 8-device equality tests in a subprocess.

``sharded_cases.py`` needs 8 devices, and the CPU device count is fixed when jax starts, so it
runs in its own ``python -m pytest`` process with ``XLA_FLAGS`` set (this also keeps it inside
the README's ``python -m pytest -n 2 --dist loadfile``).
"""

import os
import subprocess
import sys
import warnings

import jax
import pytest

from models import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parse_mesh():
  assert sharding.parse_mesh("data:2,model:2,seq:2") == {"data": 2, "model": 2, "seq": 2}
  assert sharding.parse_mesh("seq:8") == {"data": 1, "model": 1, "seq": 8}
  for bad in ("rows:2", "data:0", "data=2", "seq:x"):
    with pytest.raises(ValueError, match="mesh entry"):
      sharding.parse_mesh(bad)
  with pytest.raises(ValueError, match="devices"):
    sharding.make_mesh(data=len(jax.devices()) + 1)


def test_any_mesh_with_the_three_axes_is_taken_as_auto():
  explicit = (jax.sharding.AxisType.Explicit,) * 3
  mesh = jax.make_mesh((1, 1, 1), ("seq", "data", "model"), axis_types=explicit)
  auto = sharding.auto_mesh(mesh)
  assert auto.axis_names == mesh.axis_names and set(auto.axis_types) == {jax.sharding.AxisType.Auto}
  assert sharding.auto_mesh(auto) is auto
  with pytest.raises(ValueError, match=r"got \('x', 'y'\): build one with models.make_mesh"):
    sharding.auto_mesh(jax.make_mesh((1, 1), ("x", "y")))


def test_logical_axes_of_cache_and_state_leaves():
  assert sharding.state_logical("k", 4) == ("batch", "kv_heads", "seq", None)
  assert sharding.state_logical("prior", 3) == ("batch", "heads", "seq")
  assert sharding.state_logical("since", 1) == ("batch",)  # unlisted: batch only
  assert sharding.state_logical("unknown", 3) == ("batch", None, None)


def test_spec_drops_axes_that_do_not_divide():
  mesh = sharding.make_mesh()  # one device: nothing is split
  assert sharding.spec_for(("batch", "kv_heads", "seq", None), (2, 3, 64, 8), mesh) == \
      jax.sharding.PartitionSpec()


def _run_sharded_cases(timeout: int):
  """One ``pytest`` process over ``sharded_cases.py`` on 8 virtual CPU devices.

  XLA:CPU aborts a collective whose 8 device threads do not all arrive within its timeouts; on 2
  cores shared with other work the threads can be starved that long (a SIGABRT seen twice under
  load at the default timeouts), so they are raised far above any real step (< 1 s), yet kept
  short enough that a rendezvous that never completes (seen once in CI, 2026-11-25: every thread
  waiting in an eager op of ``lockstep``) aborts in time for a retry. A test that runs longer than
  ``faulthandler_timeout`` has every thread's stack dumped to stderr (kept in the failure
  message), so a hang names its test and the op it waits in.
  """
  flags = (os.environ.get("XLA_FLAGS", "")  # tests/conftest.py's compile settings
           + " --xla_force_host_platform_device_count=8"
           " --xla_cpu_collective_timeout_seconds=300"
           " --xla_cpu_collective_call_terminate_timeout_seconds=300")
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-v", "-x", "-p",
         "no:cacheprovider", "-o", f"faulthandler_timeout={timeout // 3}",
         os.path.join("tests", "models", "sharded_cases.py")]
  try:
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    return None, f"timed out after {timeout} s\n{out[-3000:]}\n{err[-6000:]}"
  # glog's fatal / error lines come before faulthandler's stack dump: keep them in view
  logged = "\n".join(l for l in run.stderr.splitlines() if l[:1] in "FE" and l[1:2].isdigit())
  return run, run.stdout[-4000:] + logged[-3000:] + run.stderr[-6000:]


def test_sharded_decoding_on_8_virtual_devices():
  # Alone the file takes ~4 min on 2 cores; beside the other pytest worker it once ran past
  # 15 min (2026-11-24) and once aborted in a collective that never completed (2026-11-25);
  # neither cause is established (a starved rendezvous or a lost one, in XLA:CPU). One retry
  # after a timeout or a death by signal, with the first attempt's stacks reported, keeps CI
  # from failing on it; a test that fails (a wrong number) is not retried.
  run, log = _run_sharded_cases(timeout=1000)
  if run is None or run.returncode < 0:
    warnings.warn(f"sharded_cases.py: first attempt {log}")
    run, log = _run_sharded_cases(timeout=1000)
  assert run is not None and run.returncode == 0, log
  assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout


def test_memory_plan_splits_the_cache():
  from experiments import memory_plan
  rows = {(r["layout"], r["method"]): r for r in memory_plan.plan()}
  one = rows[("data:1", "dense")]
  assert one["cache"] == 32 * 2 * 8 * 8 * 131072 * 128 * 2 + 32 * (8 * 8 * 131072 * 4 + 8 * 4)
  for layout in ("seq:8", "data:8", "model:8", "data:2,model:2,seq:2"):
    assert rows[(layout, "dense")]["cache"] * 8 <= one["cache"] + 32 * 8 * 4 * 8
  assert rows[("model:8", "dense")]["weights"] < one["weights"] / 7
  ea = rows[("data:1", "expected_attention 0.5")]
  assert 0.49 < ea["cache"] / one["cache"] < 0.52
