"""The main job's default prompt: a passage long enough for a sparse method to be sparse, with a
planted fact whose answer can be checked.

Chapter 1 of *Pride and Prejudice* (the vendored Austen text, ``experiments/common/data.py``;
~1,270 SmolLM2 tokens) with one sentence planted after its second paragraph (``FACT``, ~100
tokens in), then a question only that sentence answers. Dense SmolLM2-135M-Instruct answers it
(checked by ``tests/experiments/test_generate_main.py``), so whether a sparse method still does
says something about what its selection kept: the answer is far from the 4 sinks + 64-token
local window, among the blocks it must choose by score.
"""

from __future__ import annotations

from experiments.common import data

NOVEL = "prideprejudice"
ANSWER = "marigold"
FACT = f'The password to the gate of Netherfield Park is "{ANSWER}".'
QUESTION = ("What is the password to the gate of Netherfield Park? "
            "Answer with the password only.")
SOURCE = ("Pride and Prejudice, chapter 1 (Jane Austen, public domain), with a planted "
          "password")
_AFTER_PARAGRAPH = 3  # "Chapter 1" and the two opening paragraphs come first


def chapter_one() -> str:
  """The text of chapter 1, from its heading to the heading of chapter 2 (paragraphs kept)."""
  text = data.austen(NOVEL)
  start = text.index("Chapter 1\n")
  return text[start:text.index("Chapter 2\n", start)].strip()


def with_fact() -> str:
  """``chapter_one()`` with ``FACT`` as a paragraph of its own after the opening two."""
  paragraphs = chapter_one().split("\n\n")
  return "\n\n".join(paragraphs[:_AFTER_PARAGRAPH] + [FACT] + paragraphs[_AFTER_PARAGRAPH:])


def default_prompt() -> str:
  """``with_fact()``, a blank line, then ``QUESTION``."""
  return f"{with_fact()}\n\n{QUESTION}"


def is_right(answer: str) -> bool:
  """Whether a generated ``answer`` names the planted password."""
  return ANSWER in answer.lower()
