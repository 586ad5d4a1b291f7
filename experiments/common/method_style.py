"""One colour and one marker per method across every panel of a figure.

``assign(panels)`` takes the method names drawn in each panel and gives every method a fixed
``Style``: methods that share a panel never share a colour (greedy colouring of the graph
"drawn in the same panel", methods in sorted order, so a figure's styles are deterministic),
and no two methods share a (colour, marker) pair, so one legend entry matches one line in
every panel (a panel of more methods than colours tells its lines apart by marker). The palette's hues are distinct; matplotlib's ``tab20`` is not (its colours come
in light/dark pairs of one hue: orange and light orange read as one colour).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

# tab10's ten hues, then four more far from them (navy, gold, maroon, teal); no grey, no
# black (dense is the black dashed line).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#bcbd22", "#17becf", "#7f7f7f", "#000080", "#d4a000", "#800000", "#008080")
MARKERS = "osD^v<>ph*"


@dataclasses.dataclass(frozen=True)
class Style:
  colour: str
  marker: str


def assign(panels: Iterable[Iterable[str]]) -> dict[str, Style]:
  """``method -> Style`` for the methods of ``panels`` (one iterable of names per panel).

  Methods in sorted order take the first colour no method of their panels has yet, and the
  next marker of that colour; a panel with more methods than the palette has colours reuses
  the least-used colour with a new marker, so a (colour, marker) pair still names one method.

  Raises:
    ValueError: more methods than (colour, marker) pairs.
  """
  panels = [set(p) for p in panels]
  neighbours: dict[str, set[str]] = {}
  for p in panels:
    for m in p:
      neighbours.setdefault(m, set()).update(p - {m})
  if len(neighbours) > len(PALETTE) * len(MARKERS):
    raise ValueError(f"{len(neighbours)} methods: the palette has {len(PALETTE)} colours x "
                     f"{len(MARKERS)} markers")
  out: dict[str, Style] = {}
  used = [0] * len(PALETTE)  # methods of each colour so far: the next one's marker
  for m in sorted(neighbours):
    taken = {PALETTE.index(out[n].colour) for n in neighbours[m] if n in out}
    free = [c for c in range(len(PALETTE)) if c not in taken and used[c] < len(MARKERS)]
    c = free[0] if free else min(range(len(PALETTE)), key=lambda i: (used[i], i))
    out[m] = Style(PALETTE[c], MARKERS[used[c]])
    used[c] += 1
  return out
