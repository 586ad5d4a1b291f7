"""``method_style.assign``: one style per method, distinct colours within a panel."""

import pytest

from experiments.common import method_style

# The leaderboard's panels (results/leaderboard.png, 2026-11-26): where tab20 drew
# expected-attention and streaming_llm both orange, tova and EA:head_budget=uniform both green.
COMPRESSION = {"expected-attention", "expected-attention:head_budget=uniform", "h2o",
               "keydiff", "knorm", "snapkv", "streaming_llm", "tova"}
SELECTION = {"arkvale", "arkvale:variant=sphere", "quest", "rectified", "rectified:p=0.02",
             "rectified:p=0.05", "resa-arkvale", "resa-arkvale:variant=sphere", "resa-quest",
             "resa-topk", "retro", "topk"}


def test_colours_distinct_in_every_panel_and_one_style_per_method():
  panels = [COMPRESSION, COMPRESSION - {"knorm"}, SELECTION, SELECTION - {"retro", "topk"}]
  styles = method_style.assign(panels)
  assert set(styles) == COMPRESSION | SELECTION
  for p in panels:
    assert len({styles[m].colour for m in p}) == len(p), sorted(p)
  pairs = [(s.colour, s.marker) for s in styles.values()]
  assert len(set(pairs)) == len(pairs)
  assert styles["expected-attention"].colour != styles["streaming_llm"].colour
  assert styles == method_style.assign(reversed(panels))  # order of panels does not matter


def test_a_panel_beyond_the_palette_tells_its_methods_apart_by_marker():
  big = {f"m{i:02d}" for i in range(len(method_style.PALETTE) + 3)}
  styles = method_style.assign([big, {"m00", "x"}])
  pairs = {(s.colour, s.marker) for s in styles.values()}
  assert len(pairs) == len(styles) == len(big) + 1
  assert len({styles[m].colour for m in big}) == len(method_style.PALETTE)
  with pytest.raises(ValueError, match="palette"):
    method_style.assign([{f"m{i}" for i in range(len(method_style.PALETTE)
                                                 * len(method_style.MARKERS) + 1)}])
