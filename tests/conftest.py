"""Shared test settings: hypothesis profile sized for a 2-core CI machine."""

import os

import hypothesis
import jax

jax.config.update("jax_numpy_rank_promotion", "allow")

hypothesis.settings.register_profile(
    "ci", deadline=None, max_examples=12, derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow,
                           hypothesis.HealthCheck.data_too_large])
hypothesis.settings.register_profile(
    "dev", deadline=None, max_examples=40,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
