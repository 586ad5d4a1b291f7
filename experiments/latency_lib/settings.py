"""Benchmark settings from the ml_collections config: parsed lists, quick (CI) values resolved."""

from __future__ import annotations

import dataclasses
import os
import re

from experiments.common import quick

SECTIONS = ("per_layer", "torch_peer", "end_to_end", "memory", "resa", "prefill")
# Sections outside configs/latency.py's default run: a named shape end to end (GPU-sized) and
# one layer's prefill chunk, kernel vs in-order cuDNN (configs/latency_gpu.py).
SHAPE_SECTIONS = ("shape_e2e", "prefill_chunk", "paper")  # paper: configs/latency_gpu_claims.py


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
    valid = SECTIONS + SHAPE_SECTIONS
    bad = sorted(set(got) - set(valid))
    if bad:
      raise ValueError(f"unknown sections {bad}; valid: {valid}")
    return got

  @property
  def threads(self) -> int:
    return int(self.values["threads"]) or os.cpu_count() or 1


def resolve(config) -> Settings:
  """Settings of ``config``, quick values applied (``experiments.common.quick``) if it asks."""
  from configs import latency as latency_config  # pylint: disable=g-import-not-at-top
  if hasattr(config, "to_dict"):
    config = quick.resolve(config, latency_config.get_config)
  return Settings(dict(config.to_dict() if hasattr(config, "to_dict") else config))
