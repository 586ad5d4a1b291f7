"""methods.available(): every name make() builds, listed with its family and panels, and the
README's table of them current."""

import dataclasses
import pathlib
from typing import ClassVar

import pytest

from sparse_attn import catalog, compression, methods, selectors
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.presets import PRESETS

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_lists_every_registered_name_once():
  names = [m.name for m in methods.available()]
  assert len(names) == len(set(names))
  assert set(names) == {"dense"} | set(selectors.SELECTORS) | set(compression.BUILDERS) | set(
      PRESETS)
  for family in catalog.FAMILIES:
    assert {m.family for m in methods.available(family)} == {family}
  with pytest.raises(ValueError, match="family must be one of"):
    methods.available("eviction")


@pytest.mark.parametrize("info", methods.available(), ids=lambda m: m.name)
def test_each_listed_method_builds_as_its_family(info):
  kw = {} if info.family in ("dense", "preset") else {"budget": 0.5}
  m = methods.make(info.name, **kw)
  if info.family == "compression":
    assert isinstance(m, CompressionMethod)
  elif info.family == "sparse-decode":
    assert isinstance(m, methods.Method) and m.selector.name == info.name
  assert info.summary and set(info.panels) <= {"query_agnostic", "query_aware"} and info.panels


def test_panels_follow_kvpress_leaderboard():
  by_name = {m.name: m for m in methods.available()}
  assert by_name["finch"].query_aware and by_name["chunkkv"].query_aware
  assert by_name["snapkv"].panels == ("query_agnostic", "query_aware")
  for name in ("pyramidkv", "expected_attention", "tova", "knorm", "random"):
    assert by_name[name].panels == ("query_agnostic",) and not by_name[name].query_aware
  assert by_name["expected-attention"].panels == ("query_agnostic",)  # a preset: its base's


def test_every_compression_method_says_what_it_scores_from():
  """``SIGNAL``: each built-in compression method (and a preset of one) states it, a selector
  has none, and a subclass stating another value is refused at its definition."""
  by_name = {m.name: m for m in methods.available()}
  for m in by_name.values():
    base_is_compression = m.family == "compression" or (
        m.family == "preset" and m.spec.split(":")[0].split("+")[0] in compression.BUILDERS)
    assert (m.signal in compression.SIGNALS) if base_is_compression else m.signal is None, m
  assert [by_name[n].signal for n in ("snapkv", "criticalkv", "expected_attention", "knorm",
                                      "expected-attention")] == [
      "attention", "attention", "queries", "keys", "queries"]
  with pytest.raises(ValueError, match="SIGNAL must be one of"):
    type("Odd", (CompressionMethod,), {"SIGNAL": "vibes"})


def test_a_registered_selector_is_listed_but_not_in_the_readme_table(monkeypatch):
  @dataclasses.dataclass(frozen=True)
  class Mine(selectors.Quest):
    """Mine (a test): Quest under another name."""
    name: ClassVar[str] = "mine"

  monkeypatch.setitem(selectors.SELECTORS, "mine", Mine)
  info = {m.name: m for m in methods.available()}["mine"]
  assert info.family == "sparse-decode" and info.summary == "Mine (a test): Quest under another name."
  assert not catalog.builtin(info) and "`mine`" not in catalog.markdown()


def test_readme_table_is_current():
  text = README.read_text()
  start = text.index("\n", text.index("<!-- methods table:")) + 1
  assert text[start:text.index("<!-- end methods table -->")] == catalog.markdown(), (
      "README's methods table is stale: regenerate it with the command in its marker comment")
