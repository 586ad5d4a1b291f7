"""``checks.check_positions``: a run past the model's positions is one line, or allowed."""

import pytest

from experiments.common import checks


def test_over_long_prompt_names_both_numbers():
  with pytest.raises(ValueError) as e:
    checks.check_positions(15000, 64, 8192)
  assert str(e.value).startswith("prompt 15000 + 64 new tokens = 15064 positions exceed the "
                                 "model's max_position_embeddings 8192; pass --allow_long_context")


def test_within_positions_or_allowed_passes():
  checks.check_positions(8128, 64, 8192)  # exactly the trained context
  checks.check_positions(15000, 64, 8192, allow=True)
  with pytest.raises(ValueError):
    checks.check_positions(8129, 64, 8192)
