"""FINCH observes the whole question: a ring sized for it (``with_question_room`` /
``layer_inputs.sized_for``) equals kvpress's rule on a question longer than the default
window, and a question longer than the ring is refused, never cut to its last tokens."""

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import layer_inputs, methods
from sparse_attn.compression import finch
from tests.sparse_attn.test_compression_baselines import (B, D, HKV, HQ, LENGTHS, N_SINK, T,
                                                          WINDOW, check_kept, make_problem)
from tests.sparse_attn.test_compression_snapkv_family import budgets_of, numpy_finch, run_keep

QUESTION = 2 * WINDOW + 1  # longer than the method's own window (WINDOW)


def test_sized_ring_observes_a_question_longer_than_the_window():
  m = methods.make("finch", ratio=0.5, n_sink=N_SINK, window_size=WINDOW)
  sized = layer_inputs.sized_for(m, np.array([QUESTION, 5], np.int32))
  assert sized.window_size == finch.QUESTION_ROUND  # rounded up: few static ring shapes
  assert sized.with_question_room(QUESTION) is sized and layer_inputs.sized_for(m, None) is m
  p, budgets = make_problem(3), budgets_of(0.7)
  keep = run_keep(sized, p, budgets, finch.set_question_length, jnp.int32(QUESTION))
  for b, n in enumerate(LENGTHS):
    votes, _ = numpy_finch(p, b, n, QUESTION, None, 0.5)
    check_kept(keep[b, :, :n], votes, budgets[b])


def test_a_question_longer_than_the_ring_is_refused():
  m = methods.make("finch", ratio=0.5, window_size=WINDOW)
  state = m.init_state(B, HQ, HKV, D, T)
  np.testing.assert_array_equal(finch.set_question_length(state, WINDOW)["question"], WINDOW)
  with pytest.raises(ValueError, match="at most window_size=6 question tokens"):
    finch.set_question_length([state], np.array([2, WINDOW + 1]))
  with pytest.raises(ValueError, match="sized_for"):
    m.layer_state(state, 0, layer_inputs.LayerInputs(question_length=np.array([WINDOW + 1] * B)))
