"""Chunked prefill + jitted decode steps with a pluggable ``sparse_attn`` method.

Letters: B batch, S tokens in a step, W decode window (``method.window``), E hidden, V vocab,
T cache capacity, L layers.

Batching: prompts are **right-padded**; every row keeps its own positions ``0..len-1`` and
padding carries position -1, so it is never written to the cache. Methods write by position,
so rows of different lengths decode side by side with per-row positions and give the same
results as batch 1.

Every step is ``jax.jit``-compiled with static shapes (fixed cache capacity, fixed chunk size,
positions as arrays); caches and method states are donated. A token ``history [B, T]`` lives on
device so a step can re-read the last ``W`` tokens (retro windows) or the last ``f`` tokens
(``method.rect_interval``: dense rectification, which rewrites their K/V and never changes the
emitted tokens).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from models import kvzip_replay, llama, rope, sharding
from models.sampling import Sampling
from models.driver import Decoder, pin_prefix
from models.steps import (check_layer_methods, end_prefill, init_caches, prefill_step,
                          sample_from_hidden)
from sparse_attn.protocol import AttentionMethod

def chunk_size_for(max_len: int, prefill_chunk: int) -> int:
  """Chunk length: ``prefill_chunk``, or the next power of two >= 16 for short prompts."""
  return min(prefill_chunk, max(16, 1 << (max(max_len, 1) - 1).bit_length()))


def prefill(model, prompts: np.ndarray, lengths: np.ndarray, method: AttentionMethod, capacity: int,
            prefill_chunk: int = 512, progress=None, question_length=None):
  """Prefills right-padded ``prompts [B, S]`` in chunks, then compresses (``end_prefill``).

  ``run_prompt`` with ``end_prefill`` after it: its arguments and return values.
  """
  last, history, caches, states = run_prompt(model, prompts, lengths, method, capacity,
                                             prefill_chunk, progress, question_length)
  config = model.config.for_context(capacity)
  caches, states = end_prefill(caches, states, config=config, method=method)
  if isinstance(method, sharding.ShardedMethod):  # rows as the decode steps return them
    history = method.place_rows(history)
  return last, history, caches, states


def run_prompt(model, prompts: np.ndarray, lengths: np.ndarray, method: AttentionMethod,
               capacity: int, prefill_chunk: int = 512, progress=None, question_length=None):
  """The prompt's chunks through the model (and KVzip's replays): ``prefill`` before its
  ``end_prefill``, so a compression method's caches still hold the whole prompt.

  ``progress``: None, or ``progress("prefill", i, n)`` called after chunk ``i`` of ``n`` has
  run (the chunk is waited for, so a long prompt shows its pace). ``question_length [B]``:
  each prompt ends with a question of this many tokens (what a query-aware method such as
  FINCH observes; None: not known, the method's fallback). The method's layer states get it
  and the model's weights (``steps.init_caches``).

  Returns:
    ``(last_hidden [B, E], history [B, T], caches, states)``; ``last_hidden`` is the hidden
    state (pre final norm) of each row's last prompt token.
  """
  config, params = model.config.for_context(capacity), model.decode_params
  b, s = prompts.shape
  if np.any(lengths < 1):
    raise ValueError("every prompt needs at least one token")
  if s > capacity:
    raise ValueError(f"prompt of {s} tokens exceeds the cache capacity {capacity}")
  w = config.sliding_window  # None when the cache never outgrows it (for_context)
  if w is not None and not config.per_layer_windows and method.sliding_window != w:
    raise ValueError(
        f"the model attends a sliding window of {w} tokens < cache capacity {capacity}, but "
        f"method {method.spec!r} has sliding_window={method.sliding_window}: pass "
        "models.decode.with_model_window(method, config, capacity) (generate and "
        "teacher_forced do)")
  method.check_context(int(lengths.min()))  # e.g. a selector whose budget chooses nothing
  check_layer_methods(method, config)  # per-layer windows, soft-cap: refuse before compiling
  history = np.zeros((b, capacity), np.int32)
  history[:, :s] = prompts
  caches, states = init_caches(config, method, b, capacity, params, question_length)
  c = min(chunk_size_for(int(lengths.max()), prefill_chunk), capacity)
  last = jnp.zeros((b, config.hidden_size), llama.compute_dtype(config))
  rows = jnp.arange(b)
  n_chunks = -(-int(lengths.max()) // c)
  for start in range(0, int(lengths.max()), c):
    idx = np.arange(start, start + c)
    pos = np.where(idx[None] < lengths[:, None], idx[None], -1).astype(np.int32)
    tok = np.where(pos >= 0, np.pad(prompts, ((0, 0), (0, c)))[:, start:start + c], 0)
    h, caches, states = prefill_step(params, jnp.asarray(tok, jnp.int32), jnp.asarray(pos),
                                      caches, states, config=config, method=method)
    here = (lengths - 1 >= start) & (lengths - 1 < start + c)
    picked = h[rows, jnp.asarray(np.clip(lengths - 1 - start, 0, c - 1))]
    last = jnp.where(jnp.asarray(here)[:, None], picked, last)
    if progress is not None:
      last.block_until_ready()
      progress("prefill", start // c + 1, n_chunks)
  if hasattr(method, "replay"):  # KVzip: score the prompt by replaying it
    caches, states = kvzip_replay.replay(model, prompts, lengths, caches, states, method,
                                         config)
  return last, jnp.asarray(history), caches, states


def with_model_rope(method: AttentionMethod, config) -> AttentionMethod:
  """``method`` given the ``[D/2]`` RoPE frequencies of ``config`` (a run's:
  ``ModelConfig.for_context``, so LongRoPE's factor set is the run's) through ``with_rope``: the
  methods that model RoPE, unless they set their own, as ``experiments.common.specs.for_model``
  does."""
  give = getattr(method, "with_rope", None)
  return method if give is None else give(rope.model_inv_freq(config))


def with_model_window(method: AttentionMethod, config, capacity: int):
  """``method`` with the model's sliding window (Mistral) when the cache can outgrow it.

  A model whose layers have windows of their own (Gemma's local and global layers,
  ``config.per_layer_windows``) gets ``method`` back unchanged: the decode steps give each
  layer its window (``steps.layer_method``); here the method is only checked.

  Raises:
    NotImplementedError: the method has no window mask (RESA, retro, Expected Attention).
  """
  config = config.for_context(capacity)
  w = config.sliding_window
  if w is None or method.sliding_window == w:
    return method
  if config.per_layer_windows:
    check_layer_methods(method, config)
    return method
  return method.with_sliding_window(w)


def _as_batch(prompt_tokens):
  """A prompt (ids) or a list of prompts -> right-padded ``[B, S]`` and lengths ``[B]``."""
  seqs = list(prompt_tokens)
  if seqs and np.isscalar(seqs[0]):
    seqs = [seqs]
  lengths = np.array([len(s) for s in seqs], np.int32)
  out = np.zeros((len(seqs), max(int(lengths.max()), 1)), np.int32)
  for i, s in enumerate(seqs):
    out[i, :len(s)] = np.asarray(s, np.int32)
  return out, lengths


@dataclasses.dataclass
class Generation:
  """Output of ``generate``.

  Attributes:
    tokens: per row, the generated ids (cut after the first EOS when ``stop_at_eos``).
    prefill_seconds, decode_seconds: wall time (including compilation on the first call).
    prompt_tokens: total prompt tokens; decode_steps: decode steps run (per row).
  """

  tokens: list[list[int]]
  prefill_seconds: float
  decode_seconds: float
  prompt_tokens: int
  decode_steps: int

  @property
  def prefill_tokens_per_second(self) -> float:
    return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

  @property
  def decode_tokens_per_second(self) -> float:
    return len(self.tokens) * self.decode_steps / max(self.decode_seconds, 1e-9)


# Decode steps between token read-backs: the tokens stay on the device in between (no host
# sync per token); a finished batch stops at most READBACK - 1 steps late (cut at its EOS).
READBACK = 16


def generate(model, prompt_tokens, max_new_tokens: int, method: AttentionMethod,
             sampling: Sampling = Sampling(), *, prefill_chunk: int = 512,
             capacity: int | None = None, stop_at_eos: bool = True, mesh=None,
             progress=None, question_length=None) -> Generation:
  """Generates up to ``max_new_tokens`` per prompt with ``method`` as the attention.

  Args:
    model: a loaded model (``.config``, ``.params``, optional ``.tokenizer`` for EOS ids).
    prompt_tokens: one list of ids, or a list of lists (right-padded internally).
    max_new_tokens: tokens to emit per row.
    method: any ``AttentionMethod`` (its ``window`` and ``rect_interval`` are obeyed; given
      the model's RoPE, ``with_model_rope``).
    sampling: greedy / temperature / top-p with a seed.
    prefill_chunk: prompt chunk length.
    capacity: cache capacity (default: longest prompt + max_new_tokens, rounded up).
    stop_at_eos: stop a row after an EOS id (and the whole loop once all rows stopped).
    mesh: a ``(data, model, seq)`` device mesh (``models.sharding.make_mesh``): parameters,
      caches and method states sharded on it (see ``models.sharding``); None = one device.
    progress: None, or ``progress(stage, i, n)``, called after prefill chunk ``i`` of ``n``
      (``stage="prefill"``) and after new token ``i`` of ``n`` (``stage="decode"``).
    question_length: int or ``[B]``: each prompt ends with a question of this many tokens
      (``prefill``; None: not known).
  """
  model, method = sharding.prepare(model, method, mesh)
  config = model.config
  prompts, lengths = _as_batch(prompt_tokens)
  need = int(lengths.max()) + max_new_tokens
  capacity = method.round_capacity(capacity or need)
  if capacity < need:
    raise ValueError(f"capacity {capacity} < prompt + max_new_tokens = {need}")
  method = with_model_window(with_model_rope(method, config.for_context(capacity)), config,
                             capacity)
  key = jax.random.key(sampling.seed)
  t0 = time.perf_counter()
  question = None if question_length is None else np.broadcast_to(question_length, lengths.shape)
  last, history, caches, states = prefill(model, prompts, lengths, method, capacity,
                                          prefill_chunk, progress, question)
  nxt, _ = sample_from_hidden(model.params, last, jax.random.fold_in(key, 0), config=config,
                              sampling=sampling)
  history = history.at[jnp.arange(len(lengths)), jnp.asarray(lengths)].set(nxt, mode="drop")
  nxt.block_until_ready()
  t1 = time.perf_counter()
  eos = set(config.eos_token_ids)
  if getattr(model, "tokenizer", None) is not None:
    eos |= set(model.tokenizer.eos_ids)
  out: list[np.ndarray] = []  # [B] per step, read back from the device
  pending = [nxt]  # sampled on the device, not read yet: a read is a host sync

  def read():
    if pending:
      out.extend(np.asarray(jnp.stack(pending, axis=1)).T)
      pending.clear()

  loop = Decoder(model, method, history, caches, states, sampling)
  for i in range(1, max_new_tokens):
    if stop_at_eos and len(pending) >= READBACK:  # stop on EOS, checked every READBACK steps
      read()
      if np.isin(np.stack(out, axis=1), list(eos)).any(axis=1).all():
        break
    nxt, _ = loop.step(lengths + i - 1, jax.random.fold_in(key, i))  # feeds position len+i-1
    pending.append(nxt)
    if progress is not None:
      progress("decode", i + 1, max_new_tokens)
  read()
  t2 = time.perf_counter()
  toks = np.stack(out, axis=1)
  rows = []
  for r in toks.tolist():
    if stop_at_eos:
      cut = next((j for j, t in enumerate(r) if t in eos), None)
      r = r if cut is None else r[:cut + 1]
    rows.append(r)
  return Generation(rows, t1 - t0, t2 - t1, int(lengths.sum()), loop.steps)


def teacher_forced(model, tokens, prefill_len: int, method: AttentionMethod, *,
                   prefill_chunk: int = 512, capacity: int | None = None, mesh=None,
                   after_prefill=None):
  """Logits of ground-truth continuation fed one token at a time through ``method.decode``.

  The first ``prefill_len`` tokens are prefilled densely (``method.prefill``), then tokens
  ``prefill_len .. N-1`` go through the decode path (this is perplexity under sparse decoding).

  Args:
    tokens: ``[B, N]`` int ids (all rows the same length).
    prefill_len: prompt length, ``1 <= prefill_len <= N``.
    mesh: a device mesh to shard parameters, caches and states on (as in ``generate``).
    after_prefill: ``states -> states`` applied once after the prompt is prefilled (e.g.
      ``resa.set_head_params``: per-head RESA parameters for the decode steps).

  Returns:
    float32 ``[B, N - prefill_len + 1, V]``: entry ``i`` is the logits after reading token
    ``prefill_len - 1 + i`` (so ``[:, :-1]`` predicts ``tokens[:, prefill_len:]``); with the
    dense method this equals ``llama.forward(tokens)[:, prefill_len - 1:]``.
  """
  model, method = sharding.prepare(model, method, mesh)
  config = model.config
  tokens = np.asarray(tokens, np.int32)
  b, n = tokens.shape
  if not 1 <= prefill_len <= n:
    raise ValueError(f"prefill_len={prefill_len} must be in [1, {n}]")
  capacity = method.round_capacity(capacity or n)
  method = with_model_window(with_model_rope(method, config.for_context(capacity)), config,
                             capacity)
  lengths = np.full((b,), prefill_len, np.int32)
  last, history, caches, states = prefill(model, tokens[:, :prefill_len], lengths, method,
                                          capacity, prefill_chunk)
  if after_prefill is not None:
    states = after_prefill(states)
  loop = Decoder(model, method, history, caches, states, pinned=pin_prefix(tokens, capacity))
  loop.history = jnp.where(*loop.pinned, loop.history)
  _, first = sample_from_hidden(model.params, last, jax.random.key(0), config=config,
                                sampling=Sampling())
  out = [first]
  for p in range(prefill_len, n):
    out.append(loop.step(np.full((b,), p, np.int32), jax.random.key(0))[1])
  return np.asarray(jnp.stack(out, axis=1))
