"""ReSA: rectified sparse attention (dense rectification of the sparse decode's KV cache).

Sun et al., "Rectified Sparse Attention" (2025). Decoding runs group block sparse attention
(GQA-shared selection by the mean-pooled group query, ``n = max(n_min, ceil(M p))`` blocks with
``n_local`` recent blocks forced, Sec. 2.1; in this library ``make("quest", gqa="group", p=0.1)``).
Its approximation errors accumulate in the KV cache of the generated tokens; every ``f`` generated
tokens the decode loop re-encodes those ``f`` tokens in one dense causal forward pass through all
layers and overwrites their K/V (and the digests of the touched blocks) in every layer
(Sec. 2.2). Tokens already emitted are never changed; only later steps read the rectified cache.

Per layer that is ``write`` (overwrite at explicit slots, digests refreshed) plus exact causal
attention over the cache; ``sparse_attn.enhancers.compose.rectify`` adds the bookkeeping of the
other enhancers (RESA prior, retro output cache).
"""

from __future__ import annotations

import math

DEFAULT_F = 32


def interval(f) -> int:
  """Normalises the option ``f``: a positive int, or 0 for never (``0``, ``None``, ``inf``)."""
  if isinstance(f, str) and f.strip().lower() in ("inf", "infinity", "never"):
    return 0
  if f is None or (isinstance(f, float) and math.isinf(f)) or f == 0:
    return 0
  if isinstance(f, bool) or not isinstance(f, (int, float)) or f < 0 or int(f) != f:
    raise ValueError(f"rectification interval f must be a non-negative int or inf, got {f!r}")
  return int(f)


def memory_access(block_size: int, p: float, f: int) -> float:
  """ReSA's memory-access model per decode step as a fraction of dense (Sec. 2.3).

  ``1/b`` for reading the block digests, ``p`` for the selected blocks, ``1/f`` for the dense
  rectification amortised over ``f`` steps (0 when never rectified).

  Args:
    block_size: ``b``, tokens per block.
    p: fraction of the KV cache attended per step.
    f: rectification interval (0 = never).
  """
  return 1.0 / block_size + p + (1.0 / f if f else 0.0)
