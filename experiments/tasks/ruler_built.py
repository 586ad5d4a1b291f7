"""A RULER task instance before its length is fitted (``Built``), and the helpers that make one.

``ruler`` fits a ``Built`` to a target length; the task modules beside it (``ruler_qa``,
``ruler_words``) and ``ruler``'s own needle tasks build one. It lives apart so those modules
import it, and ``ruler`` imports them, with no import cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from experiments.tasks import haystack as hs


@dataclasses.dataclass(frozen=True)
class Built:
  """A task instance before its length is fitted.

  ``context(n)`` assembles the haystack of ``n`` units (``(text, needle spans)``) and
  ``answers(n)`` its references; ``hi`` bounds the search over ``n``; a target that does not
  fit ``min_units`` units is refused.
  """

  head: str
  tail: str
  prefix: str
  context: Callable[[int], tuple[str, list[tuple[int, int]]]]
  answers: Callable[[int], Sequence]
  hi: int
  depth: float | None
  metric: str = "all"
  min_units: int = 0


def split_template(template: str) -> tuple[str, str]:
  """``(head, tail)`` around a template's ``{context}``."""
  head, tail = template.split("{context}")
  return head, tail


def from_layout(layout: hs.Layout, prefix: str, answers, hi: int, depth, metric="all") -> Built:
  return Built(layout.head, layout.tail, prefix, layout.context, lambda n: tuple(answers), hi,
               depth, metric)
