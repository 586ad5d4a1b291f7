"""Benchmark settings from the ml_collections config: parsed lists and the quick (CI) overrides."""

from __future__ import annotations

import dataclasses
import os
import re

SECTIONS = ("per_layer", "torch_peer", "end_to_end", "memory", "resa", "prefill")

# --config.quick=True: every code path on tiny shapes (numbers mean nothing).
QUICK = dict(
    num_heads=4, num_kv_heads=2, head_dim=16, contexts="256", dtypes="float32", repeats=2,
    warmup=0,
    # every enhancer in one spec (one compilation), and the Pallas kernel in interpret mode
    methods=("dense,quest:gqa=group+resa+rect:f=8+retro:w=2,topk:gqa=group,"
             "quest:gqa=group,impl=pallas,interpret=true"),
    model="tiny-random", e2e_methods="dense,quest:gqa=group", prefill_contexts="64",
    decode_contexts="64", decode_steps=2, prefill_chunk=32, memory_context=512,
    memory_layers=2, memory_methods="dense,expected_attention:ratio=0.5", resa_contexts="256",
    resa_chunk=32, max_seconds_per_context=10.0,
    prefill_models="tiny-random", prefill_lengths="64,128", prefill_repeats=2,
)


def split_list(text: str) -> list[str]:
  """``"a,b:x=1,c:y=2,z=3"`` -> ``["a", "b:x=1", "c:y=2,z=3"]``.

  Commas separate items, except before a bare ``key=value...`` (a name then ``=``), which
  continues the previous method spec's inline options (``quest:gqa=group,impl=pallas+resa``).
  """
  out: list[str] = []
  for piece in (p.strip() for p in str(text).split(",")):
    if not piece:
      continue
    if out and re.match(r"^\w+=", piece):
      out[-1] += "," + piece
    else:
      out.append(piece)
  return out


def ints(text) -> list[int]:
  return [int(x) for x in split_list(text)]


@dataclasses.dataclass(frozen=True)
class Settings:
  """Resolved sizes of one run (quick overrides applied)."""

  values: dict

  def __getattr__(self, name):
    try:
      return self.values[name]
    except KeyError as e:
      raise AttributeError(name) from e

  @property
  def sections(self) -> list[str]:
    got = split_list(self.values["sections"])
    bad = sorted(set(got) - set(SECTIONS))
    if bad:
      raise ValueError(f"unknown sections {bad}; valid: {SECTIONS}")
    return got

  @property
  def threads(self) -> int:
    return int(self.values["threads"]) or os.cpu_count() or 1


def resolve(config) -> Settings:
  values = dict(config.to_dict() if hasattr(config, "to_dict") else config)
  if values.get("quick"):
    values.update(QUICK)
  return Settings(values)
