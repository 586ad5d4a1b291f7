"""The README's fenced code blocks, for the tests that run them (``tests/test_readme.py``, the
main job's test in ``tests/experiments/test_generate_main.py``)."""

import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def blocks() -> list[tuple[str, str]]:
  """``(language, code)`` of every fenced block, in order."""
  return re.findall(r"^```(\w*)\n(.*?)^```$", text(), re.S | re.M)


def code(language: str) -> list[str]:
  return [c for lang, c in blocks() if lang == language]


def main_job() -> list[str]:
  """The third bash block (after install and test): the main job's command, as argv."""
  return shlex.split(code("bash")[2])
