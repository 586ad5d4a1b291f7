"""Markdown tables and matplotlib figures rendered from result records."""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position


def fmt(x, digits: int = 4) -> str:
  if isinstance(x, float):
    return f"{x:.{digits}g}"
  return str(x)


def markdown_table(rows: Sequence[dict], columns: Sequence[str], digits: int = 4) -> str:
  """A GitHub markdown table of ``rows`` restricted to ``columns``."""
  head = "| " + " | ".join(columns) + " |"
  sep = "|" + "|".join("---" for _ in columns) + "|"
  body = ["| " + " | ".join(fmt(r.get(c, ""), digits) for c in columns) + " |" for r in rows]
  return "\n".join([head, sep, *body])


def write_markdown(workdir: str, name: str, title: str, sections: Sequence[str]) -> str:
  path = os.path.join(workdir, name)
  with open(path, "w", encoding="utf-8") as f:
    f.write(f"# {title}\n\n" + "\n\n".join(sections) + "\n")
  return path


def save_figure(fig, workdir: str, name: str) -> str:
  path = os.path.join(workdir, name)
  fig.tight_layout()
  # "tight": a legend placed beside its axes (the leaderboard's crowded panels) is never cut
  fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.05)
  plt.close(fig)
  return path


def new_figure(ncols: int = 1, nrows: int = 1, size=(5.0, 3.6)):
  return plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
