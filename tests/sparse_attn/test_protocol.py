"""Every method ``methods.make`` builds satisfies ``protocol.AttentionMethod``; closed option
sets are enums parsed once at construction."""

import dataclasses
from typing import ClassVar

import pytest

from sparse_attn import compression, methods, selectors
from sparse_attn.compression import CompressionMethod, HeadBudget, Phase
from sparse_attn.protocol import AttentionMethod, Choice, PrefillGroup

# Every registered name, every paper preset, and enhanced selectors.
SPECS = (("dense",) + tuple(sorted(selectors.SELECTORS)) + tuple(sorted(compression.BUILDERS))
         + tuple(sorted(methods.PRESETS))
         + ("quest+resa", "arkvale+resa+rect", "quest+retro:w=2", "topk+rect:f=8"))
# The protocol's members: its annotated attributes and its methods / properties.
MEMBERS = sorted(set(AttentionMethod.__annotations__)
                 | {n for n in vars(AttentionMethod) if not n.startswith("_")})


@pytest.mark.parametrize("spec", SPECS)
def test_every_method_satisfies_the_protocol(spec):
  m = methods.make(spec)
  assert isinstance(m, AttentionMethod), [n for n in MEMBERS if not hasattr(m, n)]
  group = type(m).prefill_group  # a ClassVar: the class says it, not the instance
  assert group is None or isinstance(group, PrefillGroup)
  assert group is (PrefillGroup.COMPRESSION if isinstance(m, CompressionMethod)
                   else PrefillGroup.DENSE)
  assert isinstance(m.spec, str)
  assert isinstance(m.window, int) and m.window >= 1
  assert isinstance(m.rect_interval, int) and m.rect_interval >= 0
  assert hash(m) == hash(methods.make(spec))  # static under jit


@pytest.mark.parametrize("name", sorted(compression.BUILDERS))
def test_every_compression_class_declares_the_class_vars(name):
  cls = type(methods.make(name))
  assert cls.name == name and cls.prefill_group is PrefillGroup.COMPRESSION
  assert {f.name for f in dataclasses.fields(cls)} >= {"spec", "phase", "head_budget"}


def test_prefill_group_is_a_string_enum():
  # experiments compare with the plain strings; both spellings must keep working
  assert PrefillGroup.COMPRESSION == "compression" and PrefillGroup.DENSE == "dense"
  assert methods.make("snapkv").prefill_group == "compression"
  assert methods.make("quest").prefill_group == "dense"
  assert f"{PrefillGroup.DENSE}" == "dense" and hash(PrefillGroup.DENSE) == hash("dense")


@pytest.mark.parametrize("option,enum", [("phase", Phase), ("head_budget", HeadBudget)])
def test_closed_sets_parse_once_and_name_the_valid_values(option, enum):
  for value in enum.values():
    m = methods.make("knorm", ratio=0.5, **{option: value})
    assert getattr(m, option) is enum(value) and getattr(m, option) == value
    assert dataclasses.replace(m, **{option: value}) == m
  with pytest.raises(ValueError, match=rf"{option} must be one of .*'{enum.values()[0]}'"):
    methods.make("knorm", ratio=0.5, **{option: "nope"})
  with pytest.raises(ValueError, match="must be one of"):
    enum("nope")


def test_spec_and_keyword_give_the_same_member():
  a = methods.make("snapkv:ratio=0.5,head_budget=adakv,phase=decode")
  b = methods.make("snapkv", ratio=0.5, head_budget=HeadBudget.ADAKV, phase=Phase.DECODE)
  assert (a.head_budget, a.phase) == (HeadBudget.ADAKV, Phase.DECODE)
  assert dataclasses.replace(a, spec="") == dataclasses.replace(b, spec="")


def test_a_subclass_prefill_group_is_checked_at_class_creation():
  class Shared(CompressionMethod):
    prefill_group: ClassVar = "compression"
  assert Shared.prefill_group is PrefillGroup.COMPRESSION
  with pytest.raises(ValueError, match="prefill_group must be one of"):
    class Bad(CompressionMethod):  # pylint: disable=unused-variable
      prefill_group: ClassVar = "sparse"


def test_choice_values_in_definition_order():
  assert issubclass(Phase, Choice) and Phase.values() == ("prefill", "decode", "both")
  assert HeadBudget.values() == ("uniform", "adakv")
  assert PrefillGroup.values() == ("dense", "compression")
