"""Shared test settings: XLA:CPU compile settings and a hypothesis profile for a 2-core CI
machine."""

import gc
import os
import sys
import tempfile

# Set before JAX starts its backend (pytest workers and the suite's subprocesses inherit them; a
# value already in the environment wins):
# - XLA:CPU compile settings that compile faster (tests/xla_env.py says which and why);
# - a persistent compilation cache shared by the xdist workers and subprocesses: the same
#   programs recur across tests and modules (the module fixture below drops the in-memory
#   caches). Unbounded: a size bound would make JAX list and read the whole folder under a
#   file lock on every write (measured: the suite slowed past its uncached time). Workers may
#   write one entry at once (same bytes); an entry read half-written fails to load, and JAX then
#   warns and compiles.
from tests import xla_env  # pylint: disable=g-import-not-at-top,wrong-import-position

os.environ["XLA_FLAGS"] = xla_env.with_suite_flags(os.environ.get("XLA_FLAGS", ""))
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
      "tests.isolated.reference (or tests.isolated.run)")
