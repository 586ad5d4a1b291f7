"""Block prompt processing: the prompt's cut taken one block at a time (kvpress's ``BlockPress``).

Letters: B batch, K kv heads, T slots.

KeyDiff (Park et al. 2025, arXiv 2504.15364) is evaluated under *block prompt processing*: a
device with a cache of ``n`` tokens reads the prompt in blocks of ``b`` and evicts back to ``n``
after each block, so a key competes only with the keys kept so far and its own block. kvpress
simulates that cut on a whole prompt (``BlockPress``; its leaderboard's ``block_keydiff`` is
``BlockPress(KeyDiffPress(), block_size=128)``), and so does ``block_keep``, per kv head:

  kept_0     = the first n prompt tokens,
  kept_{j+1} = the top n by the scorer over  kept_j ∪ block_j,
  block_j    = prompt tokens  n + j b  ..  n + (j + 1) b - 1   (in position order),

and the prompt keeps the last ``kept``. The scorer sees the candidates only (every other slot
reads as empty), so a score that depends on the set scores against it: KeyDiff's anchor is the
mean unit key of ``kept_j ∪ block_j``, not of the prompt. A score of each key alone (KNorm)
keeps what the whole prompt at once keeps (ties aside).

Like kvpress's, it is a simulation of the cut, not of the reading: every key is the one the whole
prompt's forward pass computed. Under the paper's block processing the later blocks' queries
attend only the kept cache, which changes the later layers' keys; that is not modelled.

Cost: ``ceil((L - n) / b)`` scorings of the whole ``[B, K, T]`` row (one ``while`` loop, rows of
a ragged batch stop as theirs ends), ``O(L^2 / b)`` where the one-shot cut is ``O(L)``.
"""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp

from sparse_attn.compression.head_budget import HeadBudget


def block_keep(rule, cache, state, scale, n, block: int, ceiling: int | None = None):
  """The slots kept when every kv head's prompt is cut to ``n`` block by block (module doc).

  Args:
    rule: the uniform head rule around the scorer (``head_budget.Uniform``).
    cache: the prompt's ``[B, K, T]`` cache (slots in position order: a prefill's).
    state, scale: the scorer's state and the softmax scale (as ``rule.keep`` takes them).
    n: ``[B]`` tokens per head to keep; block: static tokens per block (>= 1).
    ceiling: static most slots per head (None = unbounded).

  Returns:
    ``[B, K, T]`` bool, at most ``n`` slots a head, never an empty one.
  """
  n = n.astype(jnp.int32)
  valid = cache.valid
  order = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1  # a slot's index among the prompt's
  length = jnp.max(jnp.sum(valid, axis=-1, dtype=jnp.int32), axis=-1)  # [B]
  steps = jnp.max(-(-jnp.maximum(length - n, 0) // block))  # ceil division, the longest row
  lo = n[:, None, None]

  def step(j, kept):
    start = lo + j * block
    candidates = kept | (valid & (order >= start) & (order < start + block))
    view = dataclasses.replace(cache, pos=jnp.where(candidates, cache.pos, -1))
    return rule.keep(view, state, scale, n, ceiling)

  return lax.fori_loop(0, steps, step, valid & (order < lo))


@dataclasses.dataclass(frozen=True)
class BlockPrompt:
  """The ``prompt_block`` option of a scorer of keys alone (mixed in before
  ``base.CompressionMethod``): ``end_prefill`` cuts the prompt block by block (``block_keep``).

  Attributes:
    prompt_block: tokens per block; 0 (default): the whole prompt at once. kvpress's
      leaderboard runs ``block_keydiff`` at 128.
  """

  prompt_block: int = 0

  def __post_init__(self):
    super().__post_init__()
    b = self.prompt_block
    if isinstance(b, bool) or not isinstance(b, int) or b < 0:
      raise ValueError(f"prompt_block must be an int >= 0 (0: the whole prompt at once), got "
                       f"{b!r}")
    if b and self.head_budget is not HeadBudget.UNIFORM:
      raise ValueError(
          f"prompt_block cuts each kv head's prompt alone; it takes head_budget='uniform', got "
          f"{self.head_budget.value!r} (kvpress's BlockPress is no scorer AdaKVPress can wrap)")

  def keep_mask(self, cache, state, scale, n, ceiling: int | None = None):
    """``base.CompressionMethod.keep_mask``, block by block when ``prompt_block`` is set. A
    decode phase keeps its own cut (``head_rule``): blocks concern the prompt."""
    if not self.prompt_block:
      return super().keep_mask(cache, state, scale, n, ceiling)
    return block_keep(self.head_rule, cache, state, scale, n, self.prompt_block, ceiling)
