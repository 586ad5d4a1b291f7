"""Twilight (Lin et al., 2025, arXiv 2502.02770, NeurIPS 2025): hierarchical top-p pruning.

Twilight is a "Select-then-Prune" wrapper around a top-k sparse attention method (the paper's
Sec. 4; slides 5-6 of the authors' ``assets/Twilight-NIPS25.pdf``). Paired with Quest, as in
the paper, one decode step is:

1. Select: Quest picks pages at a conservative budget (``kernels.quest_scores`` on the box
   digests and the library's ``Budget`` rule, exactly what the ``quest`` selector at this
   budget, block size and ``gqa`` selects). Every slot of those pages inside the context is a
   candidate token.
2. Estimate: the query is multiplied with low-precision copies of the candidates' keys (the
   paper's SpGEMV against an INT4 key cache), scaled like the real logits, and a softmax over
   the candidates turns them into estimated attention weights.
3. Prune (top-p): per head, the smallest set of candidate tokens whose estimated weights sum
   to at least ``topp`` is kept. The paper's kernel finds a weight threshold by binary search
   (sorting-free, modified from FlashInfer's top-p sampling); here the same set is computed
   exactly with a sort.

Defaults, read from the authors' repository (github tsinghua-ideal/Twilight, commit 843ebcc):

* Quantisation (``bits=4``): ``twilight/pyimpl/quantize.py`` lines 4-13,
  ``min_max_per_token_quant_kv``: asymmetric min-max quantisation per token over the whole head
  dimension (one scale and one zero point per token and kv head, no finer groups), scale
  ``(max - min) / (2^bits - 1)`` (floored at 1e-9), codes ``round((k - min) / scale)`` clipped
  to ``[0, 2^bits - 1]``; dequantised as ``code * scale + min``. The INT4 GEMV kernel's cache
  holds the same layout (``benchmark/efficiency/bench_gemv.py`` lines 377-425: packed 4-bit keys
  with one fp16 scale and zero per (token, head)). What is quantised is the post-RoPE key
  (``twilight/pyimpl/attention.py`` lines 118-122 apply RoPE, lines 247-255 quantise
  ``key_states`` and mask the estimate to the selector's tokens). 4 bits and the top-p pruner
  are the paper's configuration ``benchmark/configs/config_quest_twi.json`` (``"min_max_quant"``,
  ``"quant_bit": 4``).
* ``topp = 0.85``: the same file, ``"weight_pruner": {"type": "top_p", "threshold": 0.85}``
  (also ``config_ds_twi.json``). The paper's own evaluation of LLaMA models states p = 0.95
  (pass ``topp=0.95`` for it); the default follows the released configuration. The softmax is
  float32 over the estimated logits with the non-candidates masked
  (``twilight/pyimpl/top_p.py`` lines 10-15).
* Base budget: Quest with ``"token_budget": 8192`` and 16-token pages (``"chunk_size": 16``)
  in ``config_quest_twi.json``: a conservative budget (a quarter of a 32k context) that the
  pruner then cuts. Here the budget is this selector's ``budget`` (the library's ``Budget``,
  default 10% of the context as for ``quest``); pass a larger one for the paper's setting.
* Sinks and local window: the authors' Quest selector (``twilight/pyimpl/quest.py``) forces
  none, and their top-p kernel starts its binary search at the first token's weight
  (``csrc/include/sampling.cuh`` line 159, ``high = probs_vec[0]``), so every token at least
  as heavy as token 0 survives. This library's ``Budget`` forces sink tokens and a local window
  for every selector; here they are always kept, ranked first, and their estimated mass counts
  towards ``topp`` (as ``sparse_attn.adaptive.topp`` does for blocks): the kept set is the
  smallest one that holds the forced tokens and reaches ``topp``. ``n_sink=0,
  local_window=0`` gives the paper's pruner exactly.
* The attention itself uses the exact keys of the kept tokens (``attention.py`` lines 295-299,
  ``use_estimated_weights_in_attn`` false in every config).

What this file simulates: the INT4 keys are made on the fly inside ``select`` (quantise, then
dequantise, then float32 dot products): the kernel's arithmetic, not its storage. The memory
saving of a real INT4 key cache (a second, 4-bit copy of K read by the SpGEMV) is not realised,
and there is no SpGEMV or binary-search kernel. ``topp = 1`` keeps every candidate (no pruning:
the base Quest selection as tokens). The authors' run keeps the first two layers dense
(``skip_first_two_layers``), a model-level choice outside a selector: the method's
``dense_layers=2`` (``"twilight:dense_layers=2"``). Measured (``results/dense_layers``,
Qwen2.5-Coder-0.5B, RULER niah_multikey_2 / _3 at 4k, 5 samples each): the two dense layers
leave Quest's answers unchanged at 2.5% and 10% and Twilight's at 10% (50% against dense's
100%), and give Twilight at 2.5% one more of 10 (0 -> 10%); the loss there is not theirs.

GQA: ``gqa="head"`` selects per query head (the authors' Python reference repeats the kv heads);
``gqa="group"`` selects once per kv head, both the Quest pages and the estimated weights from
the group's mean query (``scoring.pool_group``).

Letters: B batch, K kv heads, H selection heads (K or Hq), T slots, n candidate slots per head
(the base list's pages times ``block_size``), D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels import Impl
from sparse_attn import placement, reference, scoring, selection
from sparse_attn.selectors.base import Selector
from sparse_attn.selectors.quest import Quest

_SLACK = 1e-6  # relative: a cumulative float32 mass this close below topp counts as reaching it


def fake_quantise(k, bits: int):
  """Keys ``k [..., D]`` through ``bits``-bit asymmetric min-max quantisation per token (one
  scale and zero point over the last axis) and back -> float32, same shape."""
  k = k.astype(jnp.float32)
  lo = jnp.min(k, axis=-1, keepdims=True)
  hi = jnp.max(k, axis=-1, keepdims=True)
  levels = float(2 ** bits - 1)
  step = jnp.maximum(hi - lo, 1e-9) / levels
  code = jnp.clip(jnp.round((k - lo) / step), 0.0, levels)
  return code * step + lo


@dataclasses.dataclass(frozen=True)
class Twilight(Selector):
  """Quest pages pruned to the top-p tokens of an INT4 estimate (see the module docstring).

  Attributes (besides ``budget``, ``block_size`` and ``gqa``, which configure the base Quest
  selection):
    topp: the top-p threshold: per head, the fewest candidate tokens whose estimated attention
      mass reaches it are kept (the paper's ``p``; 0.85 in the authors' Quest configuration,
      0.95 in the paper's LLaMA runs). 1.0 keeps every candidate.
    bits: bits per key element of the estimate's quantised keys (the paper's 4).
  """

  topp: float = 0.85
  bits: int = 4

  name: ClassVar[str] = "twilight"
  token_level: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    p = self.topp
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
      raise ValueError(f"topp must be a number in (0, 1], got {p!r}")
    object.__setattr__(self, "topp", float(p))
    if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
      raise ValueError(f"bits must be an int in [1, 16], got {self.bits!r}")

  @property
  def digests(self) -> tuple[str, ...]:
    return ("box",)

  @property
  def base(self) -> Quest:
    """The candidate selector: Quest at this selector's budget, block size and ``gqa``."""
    return Quest(budget=self.budget, block_size=self.block_size, gqa=self.gqa)

  def max_tokens(self, capacity: int) -> int:
    """Static list length: the base selection's page count times ``block_size``."""
    nb = capacity // self.block_size
    return min(self.budget.max_count(capacity, self.block_size), nb) * self.block_size

  def check_context(self, context: int, spec: str):
    """The base Quest selection's check: its budget counts whole pages."""
    self.budget.check(context, self.block_size, name=f"{spec!r}")

  def select(self, q, cache, scale=None, *, impl: Impl = "auto", interpret: bool = False,
             windowed: bool = False, place=placement.ONE_DEVICE) -> selection.Selection:
    """Quest's pages, re-scored with quantised keys and pruned to the top-``topp`` tokens.

    Returns a token selection (granularity 1) of static length ``max_tokens(capacity)``: per
    head the kept slots first (forced ones, then by estimated weight), ``n_valid`` of them.
    """
    del place  # token-level: decodes on one device
    pages = self.base.select(q, cache, scale, impl=impl, interpret=interpret,
                             windowed=windowed)
    bs, hkv, d = cache.block_size, cache.num_kv_heads, cache.head_dim
    b, h, n_pages = pages.idx.shape
    n = n_pages * bs
    slots = (pages.idx[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)).reshape(b, h, n)
    listed = jnp.repeat(jnp.arange(n_pages)[None, None, :] < pages.n_valid[..., None], bs,
                        axis=-1)
    per_kv = slots.reshape(b, hkv, (h // hkv) * n)  # head h reads kv head h // (H // K)
    holds = jnp.take_along_axis(cache.valid, per_kv, axis=2).reshape(b, h, n)
    cand = listed & holds
    forced_slots = jnp.broadcast_to(self.budget.forced(cache.length, cache.capacity, 1)[:, None],
                                    cache.valid.shape)
    forced = jnp.take_along_axis(forced_slots, per_kv, axis=2).reshape(b, h, n) & cand

    keys = jnp.take_along_axis(cache.k, per_kv[..., None], axis=2).reshape(b, h, n, d)
    qs = scoring.pool_group(q.astype(jnp.float32), hkv, self.gqa)  # [B, H, D]
    scale = reference.default_scale(d, scale)
    est = scale * jnp.einsum("bhnd,bhd->bhn", fake_quantise(keys, self.bits), qs)
    mass = _softmax(est, cand)

    key = jnp.where(forced, 2.0 + mass, jnp.where(cand, mass, -1.0))
    top, order = jax.lax.top_k(key, n)
    ids = jnp.take_along_axis(slots, order, axis=-1)
    ok = top >= 0.0
    n_forced = jnp.sum(top >= 2.0, axis=-1)
    if self.topp >= 1.0:  # static: no pruning
      keep = jnp.sum(ok, axis=-1)
    else:
      m_sorted = jnp.where(ok, jnp.take_along_axis(mass, order, axis=-1), 0.0)
      before = jnp.cumsum(m_sorted, axis=-1) - m_sorted  # mass ranked above each entry
      keep = jnp.sum(ok & (before < self.topp * (1.0 - _SLACK)), axis=-1)
    keep = jnp.maximum(keep, n_forced)
    return selection.Selection(idx=ids.astype(jnp.int32), n_valid=keep.astype(jnp.int32),
                               granularity=1)


def _softmax(logits, mask):
  """Softmax of ``logits [..., n]`` over the ``mask``-ed entries (0 elsewhere; all 0 for a row
  with none)."""
  m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  e = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
