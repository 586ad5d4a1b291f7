"""Shared test settings: XLA:CPU compile settings and a hypothesis profile for a 2-core CI
machine."""

import gc
import os
import sys
import tempfile

# The suite's time goes mostly to XLA:CPU compiling hundreds of small programs, not to running
# them. Set before JAX starts its backend (pytest workers and the suite's subprocesses inherit
# them; a value already in the environment wins):
# - LLVM at -O0 compiles faster; every test compares against a reference with a tolerance that
#   holds at any optimisation level (the library itself runs at XLA's default).
# - a persistent compilation cache shared by the xdist workers and subprocesses: the same
#   programs recur across tests and modules (the module fixture below drops the in-memory
#   caches). Unbounded: a size bound would make JAX list and read the whole folder under a
#   file lock on every write (measured: the suite slowed past its uncached time). Workers may
#   write one entry at once (same bytes); an entry read half-written fails to load, and JAX then
#   warns and compiles.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "sparse-attn-tests-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import hypothesis  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_numpy_rank_promotion", "allow")

hypothesis.settings.register_profile(
    "ci", deadline=None, max_examples=12, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow,
                           hypothesis.HealthCheck.data_too_large])
hypothesis.settings.register_profile(
    "dev", deadline=None, max_examples=40,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_executables():
  """Drops JAX's compilation caches after every test module.

  Each compiled XLA:CPU executable holds ~3 memory mappings until its cache entry goes; a pytest
  worker that runs hundreds of tests reached ~45,000 mappings and, at the kernel's limit
  (``vm.max_map_count``, 65,530 by default), crashed inside the next compilation (a segmentation
  fault in ``backend_compile_and_load``), which then hung the suite.
  """
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _no_torch_in_the_worker():
  """PyTorch stays out of pytest workers (``tests.isolated`` says why): fail the test that
  imported it."""
  yield
  assert "torch" not in sys.modules, (
      "this test imported torch into the pytest worker; compute PyTorch references with "
      "tests.isolated.run")
