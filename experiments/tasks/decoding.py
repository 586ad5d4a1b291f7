"""Decode loops for the task experiments: shared dense prefill, greedy runs, lockstep forcing.

Built on ``models.decode.prefill`` and the one decode schedule (``models.driver.Decoder``). What
this adds for experiments on a CPU:

* **shared prefill**: every ``Method`` prefills densely and ends the prompt with exactly
  dense's cache, and its enhancer state (RESA prior, retro ring) is a function of the prompt,
  so one prefill of the methods' union serves them all (a copy each); compression methods share
  one prefill too (``experiments.tasks.compression_union``), each evicting on its own;
* **query-agnostic compression** (``extend``): the context is prefilled (and compressed), and
  the question is then read in one chunk through the kept cache (``method.extend``; any method
  one decode step per token: ``extend_stepwise``), as in Expected Attention's protocol (the
  cache is compressed before the question is seen);
* **lockstep teacher forcing**: all methods read the same token stream step by step, and the
  per-token NLL and KL(reference || method) are reduced on device, so no ``[N, V]`` logits
  are kept (perplexity under sparse decoding, ReSA Sec. 3.2; KL along a trajectory, ReSA Fig. 1);
* a per-step ``hook(label, step, states)`` to read method state (retro's effective budget,
  selection overlap);
* a device mesh (``mesh=``, ``models.sharding``): the methods (and the shared prefill's union)
  are wrapped in ``ShardedMethod`` only where they run, so the unions are built from the plain
  methods; the model's parameters must already be placed (``sharding.shard``).

Letters: B batch, N tokens, V vocab, T cache capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from experiments.tasks import compression_union, prefill_groups
# decoding.prefill_order: the order callers give prefill_all
from experiments.tasks.prefill_groups import prefill_order  # pylint: disable=unused-import
from models import decode, driver, sharding, steps
from models.sampling import Sampling
from sparse_attn import cache as cache_lib
from sparse_attn.protocol import PrefillGroup

GREEDY = Sampling()


@dataclasses.dataclass
class Prefilled:
  """A prefilled batch for one method: ``last [B, E]`` hidden, ``history [B, T]``, caches.

  ``first [B]``: the first generated token when it is already known (after ``extend``; it is
  then written in ``history`` at ``lengths``); None: sampled from ``last``. ``mesh``: the
  device mesh the caches live on (None: one device); the decode loops run the method there.
  """

  last: jax.Array
  history: jax.Array
  caches: object
  states: object
  lengths: np.ndarray
  capacity: int
  first: jax.Array | None = None
  mesh: jax.sharding.Mesh | None = None


def prefill_all(model, prompts: np.ndarray, lengths: np.ndarray, method_list, capacity: int,
                prefill_chunk: int = 512, mesh=None, question_length=None):
  """Yields ``(method, Prefilled)`` for each method, sharing one dense prefill where possible.

  The ``Method``s of one (block size, capacity) share one prefill of their union
  (``prefill_groups.prefill_union``): the dense cache is copied and each takes its part of
  the union's enhancer state. Compression methods of one (block size, capacity) share one
  prefill of a ``CompressionUnion`` and each evicts from it with its own ``end_prefill`` (on
  a soft-capped or windowed model, which the union cannot attend, each prefills on its own);
  where there is one, a ``Method`` without an enhancer state (dense, a plain selector:
  ``prefill_groups.joins_compression``) takes that prefill too, its block digests computed
  from the keys. Methods are yielded one at a time, in the order given (the caller runs one
  to completion before the next), so at most the shared prefill and one working copy are
  alive; give them in
  ``prefill_order`` so that no shared prefill runs twice. With ``mesh``, every prefill runs
  sharded and the yielded ``Prefilled`` carries the mesh (``greedy`` / ``extend`` decode
  there). ``question_length [B]``: each prompt ends with its question of this many tokens
  (FINCH's window, ``models.decode.prefill``); None: not known.
  """
  cfg = model.config
  keys = prefill_groups.prefill_keys(cfg, method_list, capacity, mesh)
  groups = {}
  for m, key in zip(method_list, keys):
    if key is not None:
      groups.setdefault(key, []).append(m)
  unions = {key: (prefill_groups.prefill_union(g) if key[0] == "dense" else
                  compression_union.CompressionUnion.of(
                      [m for m in g if m.prefill_group == PrefillGroup.COMPRESSION]))
            for key, g in groups.items()}
  shared = {}
  copy = lambda t: jax.tree.map(jnp.copy, t)
  for m, key in zip(method_list, keys):
    own = key is None or (key[0] == "dense" and not prefill_groups.shares_union(m, unions[key]))
    if own:
      run = sharding.wrap(m, mesh)
      cap = run.round_capacity(capacity)
      yield m, Prefilled(*decode.prefill(model, prompts, lengths, run, cap, prefill_chunk,
                                         question_length=question_length),
                         lengths, cap, mesh=mesh)
      continue
    if key not in shared:
      shared.clear()  # one shared prefill alive at a time
      shared[key] = decode.prefill(model, prompts, lengths, sharding.wrap(unions[key], mesh),
                                   key[2], prefill_chunk, question_length=question_length)
    last, history, caches, states = shared[key]
    if key[0] == PrefillGroup.COMPRESSION and m.prefill_group == PrefillGroup.COMPRESSION:
      mine_caches, mine = unshared(
          compression_union.split(unions[key], m, caches, states, cfg, mesh), (caches, states))
      yield m, Prefilled(last, copy(history), mine_caches, mine, lengths, key[2], mesh=mesh)
      continue
    if key[0] == PrefillGroup.COMPRESSION:  # a Method: the union's cache with its digests
      empty = m.init_state(len(lengths), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, key[2])
      mine_caches = [_with_digests(c, m.cache_digests) for c in caches]
      yield m, Prefilled(last, copy(history), unshared(mine_caches, caches),
                         [empty for _ in caches], lengths, key[2], mesh=mesh)
      continue
    like = jax.eval_shape(lambda m=m, cap=key[2]: m.init_state(
        len(lengths), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cap))
    mine = [prefill_groups.project(layer, like) for layer in states]  # states: per-layer list
    kept = [cache_lib.keep_digests(c, m.cache_digests) for c in caches]  # the method's kinds
    yield m, Prefilled(last, copy(history), copy(kept), copy(mine), lengths, key[2], mesh=mesh)


_with_digests = jax.jit(cache_lib.with_digests, static_argnums=1)


def unshared(tree, shared):
  """``tree`` with every leaf that is also a leaf of ``shared`` copied.

  A member's ``end_prefill`` may pass a buffer of the shared prefill through unchanged (ThinK's
  slices that cover a whole axis, an empty digest); its decode donates its buffers, which would
  delete them under the members that follow."""
  ids = {id(x) for x in jax.tree.leaves(shared)}
  return jax.tree.map(lambda x: jnp.copy(x) if id(x) in ids else x, tree)


# Chunk widths of ``extend`` are rounded up to this, so questions of similar lengths share
# one compiled chunk step.
EXTEND_ROUND = 32


def extend(model, pre: Prefilled, method, suffix: np.ndarray,
           suffix_lengths: np.ndarray) -> Prefilled:
  """Reads ``suffix [B, M]`` (right-padded, ``suffix_lengths [B]``, each >= 1) after a prefill.

  The tokens go through ``method.extend`` in one chunk: appended after what the cache holds
  and attended causally, so a compressed cache stays compressed (the question is read after
  eviction, Expected Attention's query-agnostic protocol); this equals ``extend_stepwise``
  (one decode step per token, ``tests/experiments/test_tasks_decoding.py``) in one pass over
  the weights. Dense and compression methods (``method.extend``). Returns the state after the
  suffix with ``first`` = each row's greedy token after its last suffix token.
  """
  suffix, suffix_lengths, total = _check_suffix(pre, method, suffix, suffix_lengths)
  b = len(pre.lengths)
  # rounded (fewer compiled shapes), but never wider than the most room a row has: a chunk is
  # written whole, so a buffer holding only the rows' room (ThinK's decode keys) must fit it
  width = min(-(-int(suffix_lengths.max()) // EXTEND_ROUND) * EXTEND_ROUND,
              pre.capacity - int(pre.lengths.min()))
  cols = np.arange(width)[None]
  ok = cols < suffix_lengths[:, None]
  tokens = np.zeros((b, width), np.int32)
  m = min(width, suffix.shape[1])
  tokens[:, :m] = suffix[:, :m]
  tokens = np.where(ok, tokens, 0)
  positions = np.where(ok, pre.lengths[:, None] + cols, -1).astype(np.int32)
  hidden, caches, states = steps.extend_step(
      model.decode_params, jnp.asarray(tokens), jnp.asarray(positions), pre.caches, pre.states,
      config=model.config, method=sharding.wrap(method, pre.mesh))
  last = hidden[jnp.arange(b), jnp.asarray(suffix_lengths - 1)]  # [B, E]
  first, _ = steps.sample_from_hidden(model.params, last, jax.random.key(0),
                                      config=model.config, sampling=GREEDY)
  rows, at = np.nonzero(ok)
  history = pre.history.at[rows, positions[rows, at]].set(tokens[rows, at])
  history = history.at[jnp.arange(b), jnp.asarray(total)].set(first)
  return Prefilled(last, history, caches, states, total, pre.capacity, first, pre.mesh)


def extend_stepwise(model, pre: Prefilled, method, suffix: np.ndarray,
                    suffix_lengths: np.ndarray, *, fused: bool | None = None) -> Prefilled:
  """``extend`` one decode step per token through ``method``'s decode path: any method
  (selectors, decode-phase compression); rows whose suffix is shorter wait (position -1).

  ``last`` is the prefill's (the steps keep no hidden state); ``first`` as ``extend``'s.
  ``fused``: each step as one device program (``models.steps.decode_step``; None: by backend).
  """
  suffix, suffix_lengths, total = _check_suffix(pre, method, suffix, suffix_lengths)
  b = len(pre.lengths)
  rows = np.arange(b)[:, None]
  cols = pre.lengths[:, None] + np.arange(suffix.shape[1])[None]
  ok = np.arange(suffix.shape[1])[None] < suffix_lengths[:, None]
  prompt = np.asarray(pre.history).copy()
  prompt[rows.repeat(suffix.shape[1], 1)[ok], cols[ok]] = suffix[ok]
  in_prompt = jnp.asarray(np.arange(pre.capacity)[None] < total[:, None])
  prompt = jnp.asarray(prompt)
  # pinned: writes inside the prompt are undone after every step
  loop = driver.Decoder(model, sharding.wrap(method, pre.mesh), jnp.copy(prompt), pre.caches,
                        pre.states, GREEDY, pinned=(in_prompt, prompt), fused=fused)
  first = jnp.zeros((b,), jnp.int32)
  for j in range(int(suffix_lengths.max())):
    newest = np.where(j < suffix_lengths, pre.lengths + j, -1 - method.window).astype(np.int32)
    nxt, _ = loop.step(newest, jax.random.key(0))
    first = jnp.where(jnp.asarray(j == suffix_lengths - 1), nxt, first)
  history = loop.history.at[jnp.arange(b), jnp.asarray(total)].set(first)
  return Prefilled(pre.last, history, loop.caches, loop.states, total, pre.capacity, first,
                   pre.mesh)


def _check_suffix(pre: Prefilled, method, suffix, suffix_lengths):
  """Validated ``(suffix, suffix_lengths, total [B])`` of an ``extend`` call."""
  if method.rect_interval:
    raise ValueError(f"{method.spec!r} rectifies; extend reads the suffix "
                     "without rectification steps")
  suffix = np.asarray(suffix, np.int32)
  suffix_lengths = np.asarray(suffix_lengths, np.int32)
  if np.any(suffix_lengths < 1) or suffix.shape[1] < suffix_lengths.max():
    raise ValueError(f"suffix lengths {suffix_lengths.tolist()} must be in [1, {suffix.shape[1]}]")
  total = pre.lengths + suffix_lengths
  if int(total.max()) >= pre.capacity:
    raise ValueError(f"prompt of {int(total.max())} tokens leaves no room in capacity "
                     f"{pre.capacity}")
  return suffix, suffix_lengths, total


def greedy(model, pre: Prefilled, method, max_new_tokens: int, *, stop_at_eos: bool = True,
           hook: Callable | None = None, fused: bool | None = None) -> list[list[int]]:
  """Greedy continuation of a prefilled batch (``models.decode.generate``'s schedule).

  ``fused``: each decode step as one device program, the GPU default (``models.steps.
  decode_step``; None: by backend, True forces it on a CPU too, False the per-layer calls).
  Returns, per row, the generated ids (cut after the first EOS with ``stop_at_eos``).
  """
  config = model.config
  eos = set(config.eos_token_ids) | set(getattr(model.tokenizer, "eos_ids", ()) or ())
  b = len(pre.lengths)
  if pre.first is not None:
    nxt, history = pre.first, pre.history
  else:
    nxt, _ = steps.sample_from_hidden(model.params, pre.last, jax.random.key(0),
                                       config=config, sampling=GREEDY)
    history = pre.history.at[jnp.arange(b), jnp.asarray(pre.lengths)].set(nxt, mode="drop")
  loop = driver.Decoder(model, sharding.wrap(method, pre.mesh), history, pre.caches,
                        pre.states, GREEDY, fused=fused)
  out = [nxt]
  for i in range(1, max_new_tokens):
    if stop_at_eos and i % 8 == 0:
      toks = np.asarray(jnp.stack(out, axis=1))
      if all(any(t in eos for t in row) for row in toks.tolist()):
        break
    nxt, _ = loop.step(pre.lengths + i - 1, jax.random.key(i))
    if hook is not None:
      hook(i, loop.states)
    out.append(nxt)
  rows = np.asarray(jnp.stack(out, axis=1)).tolist()
  if stop_at_eos:
    rows = [r[:next((j + 1 for j, t in enumerate(r) if t in eos), len(r))] for r in rows]
  return rows


@jax.jit
def _token_stats(ref_logits, logits, target):
  """``(nll [B], kl(ref || m) [B], argmax agrees [B])`` of ``[B, V]`` logits at ``target [B]``."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  lr = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(lp, target[:, None], axis=-1)[:, 0]
  kl = jnp.sum(jnp.exp(lr) * (lr - lp), axis=-1)
  agree = jnp.argmax(logits, -1) == jnp.argmax(ref_logits, -1)
  return nll, jnp.maximum(kl, 0.0), agree


def lockstep(model, tokens, prefill_len, method_map: Mapping[str, object],
             reference: str = "dense", *, hook: Callable | None = None,
             prefill_chunk: int = 512, mesh=None, fused: bool | None = None,
             prefill: Callable | None = None) -> dict[str, dict[str, np.ndarray]]:
  """Teacher-forces ``tokens [B, N]`` through every method's decode path side by side.

  The first ``prefill_len`` tokens are prefilled densely; tokens ``prefill_len .. N-1`` are
  then predicted one at a time (the first from the prefill's last position). Ragged rows:
  ``prefill_len [B]`` per row, row ``b`` holding ``prefill_len[b] + N - max(prefill_len)``
  tokens (right-padded): every row predicts as many.

  Args:
    method_map: label -> method; ``reference`` (a label in it) is the KL reference.
    hook: ``hook(label, step, states)`` after each decode step of each method; ``states`` as
      the decoder holds them (a per-layer list on the CPU layout: ``steps.stack_layers`` stacks
      it), so a hook that does not read them costs no device work.
    mesh: run every method sharded on this device mesh (the model already placed on it).
    fused: each decode step as one device program (``greedy``'s).
    prefill: ``prefill(methods, prompts, lengths, capacity)`` yielding ``(method, Prefilled)``
      (each method on its own: ``experiments.tasks.planned``); None: ``prefill_all``.

  Returns:
    label -> ``{"nll", "kl", "agree"}``, each ``[B, N - prefill_len]`` (per predicted token;
    ``kl`` is KL(reference || method) in nats, ``agree`` whether the argmaxes match).
  """
  config = model.config
  tokens = np.asarray(tokens, np.int32)
  b, n = tokens.shape
  if reference not in method_map:
    raise ValueError(f"reference {reference!r} is not among the methods {list(method_map)}")
  lengths = np.broadcast_to(np.asarray(prefill_len, np.int32), (b,)).copy()
  if not 1 <= lengths.min() <= lengths.max() < n:
    raise ValueError(f"prefill_len={prefill_len} must be in [1, {n - 1}]")
  labels = [reference] + [k for k in method_map if k != reference]
  by_method = {id(method_map[k]): k for k in labels}
  loops, logits = {}, {}
  prompts, methods = tokens[:, :int(lengths.max())], [method_map[k] for k in labels]
  if prefill is None:
    methods = [methods[i] for i in prefill_order(model, methods, n, mesh)]
  for m, pre in (prefill_all(model, prompts, lengths, methods, n, prefill_chunk, mesh)
                 if prefill is None else prefill(methods, prompts, lengths, n)):
    pinned = driver.pin_prefix(tokens, pre.capacity)
    label = by_method[id(m)]
    loops[label] = driver.Decoder(model, sharding.wrap(m, mesh), jnp.where(*pinned, pre.history),
                                  pre.caches, pre.states, GREEDY, pinned=pinned, fused=fused)
    logits[label] = steps.sample_from_hidden(model.params, pre.last, jax.random.key(0),
                                              config=config, sampling=GREEDY)[1]
  stats = {k: [] for k in labels}
  tok, rows = jnp.asarray(tokens), jnp.arange(b)
  count = n - int(lengths.max())  # tokens each row predicts
  for i in range(count):
    target = tok[rows, jnp.asarray(lengths + i)]
    for k in labels:
      stats[k].append(_token_stats(logits[reference], logits[k], target))
    if i == count - 1:
      break
    newest = lengths + i
    for k in labels:
      logits[k] = loops[k].step(newest, jax.random.key(0))[1]
      if hook is not None:
        hook(k, i + 1, loops[k].states)
  out = {}
  for k in labels:
    nll, kl, agree = (np.stack([np.asarray(s[j]) for s in stats[k]], axis=1) for j in range(3))
    out[k] = dict(nll=nll, kl=kl, agree=agree)
  return out
