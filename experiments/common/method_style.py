"""One colour and one marker per method across every panel of a figure.

``assign(panels)`` takes the method names drawn in each panel and gives every method a fixed
``Style``: methods that share a panel never share a colour (greedy colouring of the graph
"drawn in the same panel", methods in sorted order, so a figure's styles are deterministic),
and no two methods share a (colour, marker) pair, so one legend entry matches one line in
every panel. The palette's hues are distinct; matplotlib's ``tab20`` is not (its colours come
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

  Raises:
    ValueError: a panel holds more methods than the palette has colours.
  """
  panels = [set(p) for p in panels]
  if any(len(p) > len(PALETTE) for p in panels):
    raise ValueError(f"a panel of {max(map(len, panels))} methods: the palette has "
                     f"{len(PALETTE)} colours")
  neighbours: dict[str, set[str]] = {}
  for p in panels:
    for m in p:
      neighbours.setdefault(m, set()).update(p - {m})
  colour: dict[str, int] = {}
  for m in sorted(neighbours):
    taken = {colour[n] for n in neighbours[m] if n in colour}
    colour[m] = next(c for c in range(len(PALETTE)) if c not in taken)
  out, used = {}, {}
  for m in sorted(colour):  # the k-th method of one colour takes the k-th marker
    k = used.get(colour[m], 0)
    used[colour[m]] = k + 1
    out[m] = Style(PALETTE[colour[m]], MARKERS[k % len(MARKERS)])
  return out
