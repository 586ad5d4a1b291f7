"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""

import gc
import os
import sys

import hypothesis
import jax
import pytest

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
