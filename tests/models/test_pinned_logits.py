"""Teacher-forced SmolLM2 logits of six methods equal the pinned ones (``pinned_logits.py``).

The pins were written before the orchestration redesign (one method protocol, kernel dispatch in
one module, one decode driver); any change of what a method computes shows here.
"""

import numpy as np
import pytest

import models
from tests.models import pinned_logits


@pytest.fixture(scope="module")
def model():
  return models.load("smollm2-135m-instruct")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(pinned_logits.METHODS))
def test_teacher_forced_logits_equal_the_pins(model, name):
  pins = np.load(pinned_logits.PATH)
  spec, options = pinned_logits.METHODS[name]
  got = pinned_logits.summaries(model, spec, options)
  np.testing.assert_array_equal(got["argmax"], pins[f"{name}/argmax"])
  np.testing.assert_allclose(got["lse"], pins[f"{name}/lse"], rtol=0, atol=2e-4)
  np.testing.assert_allclose(got["logits"], pins[f"{name}/logits"], rtol=0, atol=2e-4)
