"""The main job's default prompt: a bundled passage long enough for a sparse method to be sparse.

Chapter 1 of *Pride and Prejudice* (the vendored Austen text, ``experiments/common/data.py``;
~1,200 SmolLM2 tokens) followed by a question whose answer sits near its start, so a method
that keeps the 4 sinks + 64-token local window must find it among the blocks it chooses.
"""

from __future__ import annotations

from experiments.common import data

NOVEL = "prideprejudice"
QUESTION = ("Who has taken Netherfield Park, and how large is his fortune? "
            "Answer in one sentence.")
SOURCE = "Pride and Prejudice, chapter 1 (Jane Austen, public domain)"


def chapter_one() -> str:
  """The text of chapter 1, from its heading to the heading of chapter 2 (paragraphs kept)."""
  text = data.austen(NOVEL)
  start = text.index("Chapter 1\n")
  return text[start:text.index("Chapter 2\n", start)].strip()


def default_prompt() -> str:
  """``chapter_one()``, a blank line, then ``QUESTION``."""
  return f"{chapter_one()}\n\n{QUESTION}"
