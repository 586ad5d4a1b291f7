"""The ``(out, lse)`` contract of a padding row on every sparse path.

Sparse decode itself is ``kernels.sparse_decode`` (the Pallas kernel or its one jnp reference,
``pallas_kernels.sparse_decode_reference``: a gather of the listed blocks, never a mask over the
whole cache).

Letters: B batch, Hq query heads, D head dim.
"""

from __future__ import annotations

import pallas_kernels


def mask_rows(out, lse, positions):
  """Rows whose query is padding attended nothing: ``out = 0``, ``lse = -inf``.

  A selection is chosen per head without looking at the query's position, so a padding row
  (``positions [B] < 0``) would attend whatever its query selected; this enforces the
  ``(out, lse)`` contract of an empty row (docs/architecture.md, "The method protocol")
  on every sparse path.

  Args:
    out: ``[B, Hq, ..., D]``; lse: ``[B, Hq, ...]``; positions: ``[B]`` int.
  """
  return pallas_kernels.empty_padding_rows(out, lse, positions)
