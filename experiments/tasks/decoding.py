"""Decode loops for the task experiments: shared dense prefill, greedy runs, lockstep forcing.

Built on ``models.decode``'s jitted steps (``prefill``, ``decode_step``, ``rectify_step``). What
this adds for experiments on a CPU:

* **shared prefill**: every method prefills densely, and a plain method (no enhancer state,
  not a compression method) ends the prompt with exactly dense's cache, so one dense prefill
  serves them all (a copy each); RESA / retro / compression methods prefill on their own;
* **lockstep teacher forcing**: all methods read the same token stream step by step, and the
  per-token NLL and KL(reference || method) are reduced on device, so no ``[N, V]`` logits
  are kept (perplexity under sparse decoding, ReSA Sec. 3.2; KL along a trajectory, ReSA Fig. 1);
* a per-step ``hook(label, step, states)`` to read method state (retro's effective budget,
  selection overlap).

Letters: B batch, N tokens, V vocab, T cache capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models import decode
from models.sampling import Sampling
from sparse_attn import methods as methods_lib

GREEDY = Sampling()


@dataclasses.dataclass
class Prefilled:
  """A prefilled batch for one method: ``last [B, E]`` hidden, ``history [B, T]``, caches."""

  last: jax.Array
  history: jax.Array
  caches: object
  states: object
  lengths: np.ndarray
  capacity: int


def shares_dense_prefill(method) -> bool:
  """Whether ``method``'s prompt phase is plain dense attention with nothing else kept."""
  return isinstance(method, methods_lib.Method) and not method.enhanced


def prefill_all(model, prompts: np.ndarray, lengths: np.ndarray, method_list, capacity: int,
                prefill_chunk: int = 512):
  """Yields ``(method, Prefilled)`` for each method, sharing one dense prefill where possible.

  Methods are yielded one at a time (the caller runs one to completion before the next), so
  at most the shared cache and one working copy are alive.
  """
  shared = {}
  for m in method_list:
    if shares_dense_prefill(m):
      key = (m.block_size, m.round_capacity(capacity))
      if key not in shared:
        dense = methods_lib.make("dense", block_size=m.block_size)
        shared[key] = decode.prefill(model, prompts, lengths, dense, key[1], prefill_chunk)
      last, history, caches, _ = shared[key]
      _, states = decode.init_caches(model.config, m, len(lengths), key[1])
      copy = lambda t: jax.tree.map(jnp.copy, t)
      yield m, Prefilled(last, copy(history), copy(caches), states, lengths, key[1])
    else:
      cap = m.round_capacity(capacity)
      yield m, Prefilled(*decode.prefill(model, prompts, lengths, m, cap, prefill_chunk),
                         lengths, cap)


def greedy(model, pre: Prefilled, method, max_new_tokens: int, *, stop_at_eos: bool = True,
           hook: Callable | None = None) -> list[list[int]]:
  """Greedy continuation of a prefilled batch (``models.decode.generate``'s schedule).

  Returns, per row, the generated ids (cut after the first EOS with ``stop_at_eos``).
  """
  config, params = model.config, model.params
  eos = set(config.eos_token_ids) | set(getattr(model.tokenizer, "eos_ids", ()) or ())
  b = len(pre.lengths)
  nxt, _ = decode.sample_from_hidden(params, pre.last, jax.random.key(0), config=config,
                                     sampling=GREEDY)
  history = pre.history.at[jnp.arange(b), jnp.asarray(pre.lengths)].set(nxt, mode="drop")
  caches, states = pre.caches, pre.states
  out = [nxt]
  w, f = method.window, method.rect_interval
  for i in range(1, max_new_tokens):
    if stop_at_eos and i % 8 == 0:
      toks = np.asarray(jnp.stack(out, axis=1))
      if all(any(t in eos for t in row) for row in toks.tolist()):
        break
    newest = pre.lengths + i - 1
    nxt, _, history, caches, states = decode.decode_step(
        params, history, jnp.asarray(decode.window_positions(newest, w)), caches, states,
        jax.random.key(i), config=config, method=method, sampling=GREEDY)
    if f and i % f == 0:
      caches, states = decode.rectify_step(params, history,
                                           jnp.asarray(decode.window_positions(newest, f)),
                                           caches, states, config=config, method=method)
    if hook is not None:
      hook(i, states)
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


def lockstep(model, tokens, prefill_len: int, method_map: Mapping[str, object],
             reference: str = "dense", *, hook: Callable | None = None,
             prefill_chunk: int = 512) -> dict[str, dict[str, np.ndarray]]:
  """Teacher-forces ``tokens [B, N]`` through every method's decode path side by side.

  The first ``prefill_len`` tokens are prefilled densely; tokens ``prefill_len .. N-1`` are
  then predicted one at a time (the first from the prefill's last position).

  Args:
    method_map: label -> method; ``reference`` (a label in it) is the KL reference.
    hook: ``hook(label, step, states)`` after each decode step of each method.

  Returns:
    label -> ``{"nll", "kl", "agree"}``, each ``[B, N - prefill_len]`` (per predicted token;
    ``kl`` is KL(reference || method) in nats, ``agree`` whether the argmaxes match).
  """
  config, params = model.config, model.params
  tokens = np.asarray(tokens, np.int32)
  b, n = tokens.shape
  if reference not in method_map:
    raise ValueError(f"reference {reference!r} is not among the methods {list(method_map)}")
  if not 1 <= prefill_len < n:
    raise ValueError(f"prefill_len={prefill_len} must be in [1, {n - 1}]")
  lengths = np.full((b,), prefill_len, np.int32)
  labels = [reference] + [k for k in method_map if k != reference]
  by_method = {id(method_map[k]): k for k in labels}
  run, tok = {}, jnp.asarray(tokens)
  for m, pre in prefill_all(model, tokens[:, :prefill_len], lengths,
                            [method_map[k] for k in labels], n, prefill_chunk):
    hist = pre.history.at[:, :n].set(tok)
    _, first = decode.sample_from_hidden(params, pre.last, jax.random.key(0), config=config,
                                         sampling=GREEDY)
    run[by_method[id(m)]] = dict(m=m, hist=hist, caches=pre.caches, states=pre.states,
                                 logits=first)
  stats = {k: [] for k in labels}
  for i, p in enumerate(range(prefill_len - 1, n - 1)):
    target = tok[:, p + 1]
    ref_logits = run[reference]["logits"]
    for k in labels:
      stats[k].append(_token_stats(ref_logits, run[k]["logits"], target))
    if p + 1 == n - 1:
      break
    newest = np.full((b,), p + 1, np.int32)
    for k in labels:
      r, m = run[k], run[k]["m"]
      _, logits, hist, caches, states = decode.decode_step(
          params, r["hist"], jnp.asarray(decode.window_positions(newest, m.window)),
          r["caches"], r["states"], jax.random.key(0), config=config, method=m,
          sampling=GREEDY)
      hist = hist.at[:, :n].set(tok)  # undo the sampled write
      if m.rect_interval and (i + 1) % m.rect_interval == 0:
        caches, states = decode.rectify_step(
            params, hist, jnp.asarray(decode.window_positions(newest, m.rect_interval)),
            caches, states, config=config, method=m)
      r.update(hist=hist, caches=caches, states=states, logits=logits)
      if hook is not None:
        hook(k, i + 1, states)
  out = {}
  for k in labels:
    nll, kl, agree = (np.stack([np.asarray(s[j]) for s in stats[k]], axis=1) for j in range(3))
    out[k] = dict(nll=nll, kl=kl, agree=agree)
  return out
