"""The overlap of two methods' kept tokens (or channels), per layer and kv head, as the kvpress
parity scripts print it: ``|ours & theirs| / |theirs|``, its minimum, mean and the share of
identical cells."""

from __future__ import annotations

import numpy as np


TABLE_HEAD = ("| ours | kvpress | min overlap | mean overlap | identical cells |\n"
              "|---|---|---|---|---|")


def per_layer(num_layers: int, kept_pair) -> np.ndarray:
  """``[layers * K]`` ``|ours & theirs| / |theirs|`` per (layer, kv head), where
  ``kept_pair(layer)`` gives both sides' ``[K, S]`` boolean kept masks of one layer."""
  out = []
  for layer in range(num_layers):
    a, b = kept_pair(layer)
    out.append((a & b).sum(-1) / b.sum(-1))
  return np.concatenate(out)


def table_row(ours: str, theirs: str, o: np.ndarray) -> str:
  """One row under ``TABLE_HEAD``: min, mean and share of identical cells of overlaps ``o``."""
  return (f"| {ours} | {theirs} | {o.min():.4f} | {o.mean():.4f} | "
          f"{np.mean(o == 1.0):.1%} of {o.size} |")
