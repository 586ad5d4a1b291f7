"""The overlap of two methods' kept tokens (or channels), per layer and kv head, as the kvpress
parity scripts print it: ``|ours & theirs| / max(|ours|, |theirs|)``, its minimum, mean and the
share of identical cells. The larger set in the denominator makes 1 mean the same set: a side
that kept more tokens than the other (a superset) scores below 1."""

from __future__ import annotations

import numpy as np


TABLE_HEAD = ("| ours | kvpress | min overlap | mean overlap | identical cells |\n"
              "|---|---|---|---|---|")


def overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """``|a & b| / max(|a|, |b|)`` over the last axis of boolean kept masks ``a, b [..., S]``:
  1 exactly where the two kept sets are equal (two empty sets count as equal)."""
  both = (a & b).sum(-1)
  larger = np.maximum(a.sum(-1), b.sum(-1))
  return np.where(larger > 0, both / np.maximum(larger, 1), 1.0)


def per_layer(num_layers: int, kept_pair) -> np.ndarray:
  """``[layers * K]`` ``overlap`` per (layer, kv head), where ``kept_pair(layer)`` gives both
  sides' ``[K, S]`` boolean kept masks of one layer."""
  return np.concatenate([overlap(*kept_pair(layer)) for layer in range(num_layers)])


def table_row(ours: str, theirs: str, o: np.ndarray) -> str:
  """One row under ``TABLE_HEAD``: min, mean and share of identical cells of overlaps ``o``."""
  return (f"| {ours} | {theirs} | {o.min():.4f} | {o.mean():.4f} | "
          f"{np.mean(o == 1.0):.1%} of {o.size} |")
