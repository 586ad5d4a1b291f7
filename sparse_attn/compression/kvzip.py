"""KVzip: query-agnostic KV eviction by context reconstruction (arXiv 2505.23416).

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", Sec. 3,
as the authors' code and kvpress's ``KVzipPress`` compute it. Letters: B batch, K kv heads,
G group, N = K G query heads, S replay tokens, T slots, D head dim.

After the prompt, the model is asked to repeat it: for each chunk of ``chunk_size`` (2,048)
context tokens, a *replay* ``"\\n\\nRepeat the previous context exactly."`` (later chunks: ``"...
the part of the previous context exactly, starting with"`` + the previous chunk's last 8
tokens), the chat template's assistant header, then the chunk itself, is run through the model
at the positions after the prompt, attending the cache and its own tokens (``replay``; the
cache is not written). A context key's score is how much the replay's queries need it:

  a_{h,s,i} = softmax_{i in sinks ∪ chunk ∪ replay_{<=s}}( <q_{h,s}, k_i> scale )
  score_i = max_{h in group(i's head), s} a_{h,s,i}            for i in the chunk,

the softmax over only the ``min(n_sink, start)`` leading sinks, the chunk and the replay's own
causal keys (Eq. 2, with kvpress's and the authors' subsampled keys). The sinks (``n_sink = 4``)
are never evicted. ``models.kvzip_replay`` runs the replays between the prefill and
``end_prefill`` (about twice the prefill's cost); ``state["span"]`` is the chunk the next
replay reconstructs (``[start, end)`` token positions).

Selection (``layerwise``): the authors (``KVCache.prune``, ``level="pair"``: one threshold over
the stacked scores of every layer) and kvpress (``layerwise=False``, its default) evict the
lowest ``ratio`` of the scores of *all layers and heads at once*, so a layer whose replay needs
more of its keys keeps more. That is the default here: before the layers are compressed, the
model's top ``ceil((1 - ratio) L K n)`` entries are counted per layer (``across_layers``,
``cross_layer.layer_totals``) and each layer keeps its own top that many over all its heads
(Ada-KV's layer-wide top-k without a floor: ``head_budget="adakv", floor=0``, the only rule
this ranking allows). A layer compressed alone, without that pass (a one-layer benchmark),
ranks within itself. ``layerwise=True`` is kvpress's other mode: every layer evicts its lowest
``int(K n ratio)`` over all its heads (here keeping ``K ceil((1 - ratio) n)``, at most ``K`` more
than kvpress's). kvpress leaves the chat template's prefix unscored (score 0); here every
prompt token is scored.

KVzip+ (``plus=True``; kvpress's ``kvzip_plus_normalization``, its leaderboard's ``kvzip_plus``)
weighs each weight by what the key's value writes and by the query's scale before the max:

  score_i = max_{h in group(i's head), s} a_{h,s,i} ||v_i W^O_h||_2 / ||x_s||_2,

``W^O_h`` query head ``h``'s rows of the layer's output projection and ``x_s`` the replay token's
attention input (after the layer's input norm). A model run gives each layer its ``W^O``
(``layer_state``, as CriticalKV's) and the replay the norms (``models.steps``); without ``W^O``
(a layer run by hand) ``||v_i||_2`` stands in, without the norms 1.

Without a replay every score is 0 and the sinks and the earliest tokens are kept (the rank's
tie order).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sparse_attn import merge as merge_lib
from sparse_attn import reference
from sparse_attn.cache_attention import dense_over_cache
from sparse_attn.compression import cross_layer
from sparse_attn.compression import prefill as prefill_lib
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.compact import keep_count
from sparse_attn.compression.decode_phase import token_budget
from sparse_attn.compression.head_budget import HeadBudget, adakv_keep

NEG = -1e30
# Replay queries scored at once (``replay_scores``): bounds the weights' memory.
QUERY_BLOCK = 256


def replay_scores(q, k_ctx, pos_ctx, k_own, positions, span, n_sink: int, scale,
                  query_block: int = QUERY_BLOCK, chunk: int | None = None, plus=None):
  """``[B, K, T]`` KVzip scores of the chunk ``span`` (module docstring), ``-inf`` elsewhere.

  The replay's queries are taken ``query_block`` at a time (``lax.map``), so the weights live
  as ``[B, K, G, query_block, W]`` at once rather than ``[B, K, G, S, W]`` (at 128k context and
  a 2k replay chunk the whole matrix would be tens of GB). With ``chunk`` (the replay's chunk
  size: no span is wider), only the keys the softmax reads are gathered, ``W = n_sink +
  chunk`` slots (the sinks' and the chunk's, a prompt's cache holding position ``p`` at slot
  ``p``, as a compression prefill writes it), instead of every slot (``W = T``): the cost of a
  replay's scores no longer grows with the context (1/4 at 8K, 1/64 at 128K with 2K chunks).

  Args:
    q: ``[B, N, S, D]`` the replay's post-RoPE queries; positions: ``[B, S]`` (-1 = padding).
    k_ctx: ``[B, K, T, D]`` cached keys at token positions ``pos_ctx [B, K, T]`` (-1 = empty).
    k_own: ``[B, K, S, D]`` the replay's own keys.
    span: ``[B, 2]`` the chunk's ``[start, end)`` positions; n_sink, query_block, chunk:
      static; scale: float.
    plus: None (KVzip), or KVzip+'s ``(v_ctx [B, K, T, D] cached values, out_proj [N D, E] |
      None, hidden_norm [B, S] | None)`` (module docstring; ``output_norms``).
  """
  b, n, s, d = q.shape
  kh, t = k_ctx.shape[1], k_ctx.shape[2]
  start, end = span[:, 0, None, None], span[:, 1, None, None]  # [B, 1, 1]
  sink = jnp.minimum(n_sink, start)
  in_chunk = lambda pos: (pos >= start) & (pos < end)
  v_ctx, out_proj, hidden_norm = (None, None, None) if plus is None else plus
  rows = None if hidden_norm is None else 1.0 / hidden_norm.astype(jnp.float32)  # [B, S]
  if chunk is None or n_sink + chunk >= t:
    seen = (pos_ctx >= 0) & ((pos_ctx < sink) | in_chunk(pos_ctx))  # [B, K, T]
    cols = None if plus is None else output_norms(v_ctx, out_proj, n // kh)
    score = _replay_weights(q, k_ctx, seen, k_own, positions, scale, query_block, cols, rows)
    return jnp.where(in_chunk(pos_ctx) & (pos_ctx >= 0), score, -jnp.inf)
  # [B, W]: the sink slots, then the chunk's
  slots = jnp.concatenate([jnp.broadcast_to(jnp.arange(n_sink), (b, n_sink)),
                           span[:, :1] + jnp.arange(chunk)], axis=1)
  inside = slots < t
  slots = jnp.minimum(slots, t - 1)[:, None]  # [B, 1, W]
  k_sel = jnp.take_along_axis(k_ctx, slots[..., None], axis=2)  # [B, K, W, D]
  pos = jnp.where(inside[:, None], jnp.take_along_axis(pos_ctx, slots, axis=2), -1)
  is_sink = jnp.arange(n_sink + chunk) < n_sink  # sink slots count only as sinks: no key twice
  seen = (pos >= 0) & jnp.where(is_sink, pos < sink, in_chunk(pos))  # [B, K, W]
  cols = None if plus is None else output_norms(
      jnp.take_along_axis(v_ctx, slots[..., None], axis=2), out_proj, n // kh)
  score = _replay_weights(q, k_sel, seen, k_own, positions, scale, query_block, cols, rows)
  score = jnp.where(seen & ~is_sink, score, -jnp.inf)[..., n_sink:]  # [B, K, chunk]
  bi, ki = jnp.indices((b, kh))
  out = jnp.full((b, kh, t + 1), -jnp.inf, score.dtype)  # slot t: past the cache, dropped
  dest = jnp.where(inside[:, None, n_sink:], slots[..., n_sink:], t)
  return out.at[bi[..., None], ki[..., None], dest].set(score)[..., :t]


def output_norms(v, out_proj, group: int):
  """``[B, K, G, W]``: ``||v_i W^O_h||_2`` of values ``v [B, K, W, D]`` for each query head ``h``
  of a kv head's group (KVzip+), ``W^O`` the layer's ``out_proj [N D, E]``; ``||v_i||_2`` for
  every head without one. Through each head's ``[D, D]`` Gram matrix ``W^O_h W^O_h^T``: ``N D^2
  E + W N D^2`` multiply-adds, not the ``W N D E`` of projecting every value."""
  v = v.astype(jnp.float32)
  b, kh, w, d = v.shape
  if out_proj is None:
    return jnp.broadcast_to(jnp.linalg.norm(v, axis=-1)[:, :, None], (b, kh, group, w))
  wo = out_proj.astype(jnp.float32).reshape(kh, group, d, -1)  # [K, G, D, E]
  gram = jnp.einsum("kgde,kgfe->kgdf", wo, wo)
  quad = jnp.einsum("bkwd,kgdf,bkwf->bkgw", v, gram, v)
  return jnp.sqrt(jnp.maximum(quad, 0.0))


def _replay_weights(q, k_ctx, seen, k_own, positions, scale, query_block: int, cols=None,
                    rows=None):
  """``[B, K, W]``: each context key's largest softmax weight over the group and the replay's
  queries, the softmax over the ``seen [B, K, W]`` keys ``k_ctx [B, K, W, D]`` and the replay's
  own causal keys (``replay_scores``; 0 where not seen); KVzip+ weighs each weight by its key's
  ``cols [B, K, G, W]`` and its query's ``rows [B, S]`` first (None: 1)."""
  b, n, s, d = q.shape
  kh = k_ctx.shape[1]
  blk = min(query_block, s)
  nb = -(-s // blk)
  pad = nb * blk - s
  qg = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
  qg = qg.reshape(b, kh, n // kh, nb, blk, d).transpose(3, 0, 1, 2, 4, 5)  # [nb,B,K,G,blk,D]
  q_pos = jnp.pad(positions, ((0, 0), (0, pad)), constant_values=-1)
  q_pos = q_pos.reshape(b, nb, blk).transpose(1, 0, 2)  # [nb, B, blk]
  xs = (qg, q_pos)
  if rows is not None:  # KVzip+: each block's query weights
    xs += (jnp.pad(rows, ((0, 0), (0, pad))).reshape(b, nb, blk).transpose(1, 0, 2),)
  k_ctx = k_ctx.astype(jnp.float32)
  k_own = k_own.astype(jnp.float32)
  own_ok = positions >= 0  # [B, S]

  def block_max(args):  # the largest weight of each context key over one block's queries
    qb, pb, *rb = args  # [B, K, G, blk, D], [B, blk], KVzip+'s [B, blk]
    lc = jnp.einsum("bkgsd,bktd->bkgst", qb, k_ctx) * scale  # [B, K, G, blk, W]
    lo = jnp.einsum("bkgsd,bkud->bkgsu", qb, k_own) * scale  # [B, K, G, blk, S]
    ok = pb >= 0
    causal = (positions[:, None, :] <= pb[:, :, None]) & own_ok[:, None, :] & ok[:, :, None]
    lc = jnp.where(seen[:, :, None, None, :], lc, NEG)
    lo = jnp.where(causal[:, None, None], lo, NEG)
    mx = jnp.maximum(jnp.max(lc, -1, keepdims=True), jnp.max(lo, -1, keepdims=True))
    den = (jnp.sum(jnp.exp(lc - mx), -1, keepdims=True)
           + jnp.sum(jnp.exp(lo - mx), -1, keepdims=True))
    w = jnp.where(seen[:, :, None, None, :], jnp.exp(lc - mx) / den, 0.0)
    w = jnp.where(ok[:, None, None, :, None], w, 0.0)  # padding queries score nothing
    if rb:
      w = w * rb[0][:, None, None, :, None]
    if cols is not None:
      w = w * cols[:, :, :, None, :]
    return jnp.max(w, axis=(2, 3))

  return jnp.max(jax.lax.map(block_max, xs), axis=0)


def replay_attention(q, k, v, cache, positions, scale=None, *, softcap=None, window=None):
  """``[B, N, S, D]``: a replay chunk's exact attention over the cache and its own keys
  (causal), the cache unwritten. q: ``[B, N, S, D]``; k, v: ``[B, K, S, D]``; positions
  ``[B, S]`` (-1 = padding)."""
  scale = reference.default_scale(q.shape[-1], scale)
  past = dense_over_cache(q, cache, positions, scale, softcap=softcap, window=window)
  own = reference.attention(q, k, v, None, scale, q_positions=positions,
                            k_positions=positions, softcap=softcap, window=window)
  out, _ = merge_lib.merge(past, own)
  return out.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class KVzip(CompressionMethod):
  """KVzip eviction (arXiv 2505.23416; kvpress's ``KVzipPress``).

  Attributes:
    chunk_size: context tokens reconstructed per replay (2,048).
    layerwise: False (the paper's and kvpress's default): one ranking over all layers and
      heads; True: each layer keeps ``K ceil((1 - ratio) n)`` (module docstring).
    plus: KVzip+ (module docstring): each weight times ``||v W^O_h|| / ||x_s||``.
  """

  chunk_size: int = 2048
  layerwise: bool = False
  plus: bool = False

  name = "kvzip"
  SIGNAL = "attention"  # the attention of the context's reconstruction
  DEFAULTS = {"n_sink": 4, "head_budget": HeadBudget.ADAKV, "floor": 0.0}

  def __post_init__(self):
    super().__post_init__()
    c = self.chunk_size
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
      raise ValueError(f"chunk_size must be an int >= 1, got {c!r}")
    if self.compresses_decode:
      raise ValueError("kvzip scores the prompt by replaying it (phase='prefill'), as kvpress")
    for field in ("layerwise", "plus"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
    if not self.layerwise and (self.head_budget is not HeadBudget.ADAKV or self.floor != 0):
      raise ValueError(
          "kvzip ranks all layers and heads at once (layerwise=False), so a layer's heads share "
          "its count with no floor (head_budget='adakv', floor=0); got head_budget="
          f"{self.head_budget!s}, floor={self.floor}: pass layerwise=True for a per-layer budget")

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    return {"score": jnp.zeros((batch, num_kv_heads, capacity), jnp.float32),
            "span": jnp.zeros((batch, 2), jnp.int32),
            # entries this layer keeps under the model-wide ranking (-1: rank within the layer)
            "layer_keep": jnp.full((batch,), -1, jnp.int32)}

  def layer_keep_bound(self, n: int) -> int:
    """A model-wide ranking may keep every token of one layer (``base``)."""
    return self.prompt_keep(n) if self.layerwise else n

  def across_layers(self, caches, states, scale=None):
    """Per-layer ``states`` with ``layer_keep [B]``: how many of the model's top ``ceil((1 -
    ratio) L K n)`` scores each layer holds (``cross_layer``); unchanged when ``layerwise``.
    caches, states: per-layer lists after the replays."""
    if self.layerwise or not self.compresses_prefill:
      return states
    n = prefill_lib.prompt_tokens(caches[0])
    scores = [self.slot_scores(c, s, scale, self.prompt_keep(n))
              for c, s in zip(caches, states, strict=True)]
    entries = sum(c.num_kv_heads for c in caches) * n
    totals = cross_layer.layer_totals(scores, keep_count(entries, self.ratio))
    return [dict(s, layer_keep=t) for s, t in zip(states, totals, strict=True)]

  def prefill_keep(self, cache, state, scale=None):
    """``(keep [B, K, T], budget [B])``: the layer's top ``state["layer_keep"]`` entries over
    all its heads (the model-wide ranking's share), or its own budget (``layerwise``, or no
    ``across_layers`` pass)."""
    if self.layerwise:
      return super().prefill_keep(cache, state, scale)
    n = prefill_lib.prompt_tokens(cache)
    kept = self.prompt_keep(n)
    own = cache.num_kv_heads * kept
    total = jnp.where(state["layer_keep"] >= 0, state["layer_keep"], own)
    keep = adakv_keep(self.slot_scores(cache, state, scale, kept), kept, 0.0, total=total)
    return keep & cache.valid, token_budget(n, kept, self.max_tokens)

  @property
  def reads_hidden_norm(self) -> bool:
    """Whether a replay needs its tokens' attention-input norms (``models.steps`` passes
    ``hidden_norm``): KVzip+'s ``||x_s||``."""
    return self.plus

  def layer_state(self, state, layer: int, inputs=None):
    """KVzip+: the state with the layer's output projection (``sparse_attn.layer_inputs``; a
    copy, no batch axis, as CriticalKV's), if given."""
    del layer
    if not self.plus or inputs is None or inputs.out_proj is None:
      return state
    return dict(state, out_proj=jnp.array(inputs.out_proj, copy=True))

  def replay(self, q, k, v, cache, state, positions, *, scale=None, hidden_norm=None):
    """A replay chunk (module docstring): attends the cache and its own keys causally, records
    the scores of the chunk ``state["span"]`` and writes nothing.

    Args:
      q: ``[B, N, S, D]`` post-RoPE queries; k, v: ``[B, K, S, D]``.
      positions: ``[B, S]`` token positions after the prompt (-1 = padding).
      hidden_norm: ``[B, S]`` the tokens' attention-input norms (KVzip+), or None.

    Returns:
      ``(out [B, N, S, D], cache, state)``.
    """
    out = replay_attention(q, k, v, cache, positions, scale, softcap=self.softcap,
                           window=self.sliding_window)
    return out, cache, self.record_replay(q, k, cache, state, positions, scale=scale,
                                          hidden_norm=hidden_norm)

  def record_replay(self, q, k, cache, state, positions, *, scale=None, hidden_norm=None):
    """``state`` with the scores of the chunk ``state["span"]`` that the replay ``q [B, N, S,
    D]`` (own keys ``k [B, K, S, D]``, ``positions [B, S]``, KVzip+'s ``hidden_norm [B, S]``)
    gives; what ``replay`` records (the shared compression prefill records it for each KVzip
    member it serves)."""
    scale = reference.default_scale(q.shape[-1], scale)
    plus = (cache.v, state.get("out_proj"), hidden_norm) if self.plus else None
    new = replay_scores(q, cache.k, cache.pos, k, positions, state["span"], self.n_sink, scale,
                        chunk=self.chunk_size, plus=plus)
    return dict(state, score=jnp.where(new > -jnp.inf, new, state["score"]))

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: the replays' scores (sinks forced by ``slot_scores``)."""
    del cache, scale, n
    return state["score"]

  def compact_state(self, state, idx):
    del idx
    state = {key: x for key, x in state.items() if key != "out_proj"}
    return dict(state, score=state["score"][:, :, :0])
