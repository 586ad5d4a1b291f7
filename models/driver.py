"""The decode schedule, written once: every loop that decodes past a prefill steps a ``Decoder``.

One step (``Decoder.step``) feeds the window of the newest ``method.window`` positions
(``window_positions``; RetroAttention re-reads its window, other methods read one token) through
``steps.decode_step``, which writes the sampled token into the history; tokens the caller pins
(teacher forcing, a prompt being read) are then restored; and after every ``method.rect_interval``
steps the last ``f`` positions are re-encoded densely (``steps.rectify_step``, ReSA's
rectification, which rewrites their K/V and never changes an emitted token).

Used by ``models.decode.generate`` / ``teacher_forced``, the task loops of
``experiments.tasks.decoding``, the latency benchmark and ``experiments.shard_memory``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models import steps
from models.sampling import Sampling
from sparse_attn.protocol import AttentionMethod


def window_positions(newest: np.ndarray, w: int) -> np.ndarray:
  """``[B, w]`` positions ``newest-w+1 .. newest`` (negative entries = not yet existing)."""
  pos = np.asarray(newest)[:, None] + np.arange(1 - w, 1)[None]
  return np.where(pos >= 0, pos, -1).astype(np.int32)


@dataclasses.dataclass
class Decoder:
  """The running state of a decode loop (mutable host-side holder of donated device buffers).

  Attributes:
    model: the loaded model (``.config``, ``.decode_params``).
    method: the attention method (its ``window`` and ``rect_interval`` set the schedule).
    history: ``[B, T]`` int32 tokens by position (the step writes its sampled token at
      ``newest + 1``).
    caches, states: the per-layer caches and method states (decode layout, donated each step).
    sampling: how the next token is drawn.
    pinned: ``(mask [B|1, T] bool, tokens [B, T])``: history entries restored after every step
      (teacher forcing; a prompt read token by token), or None.
    steps: decode steps taken so far (rectification runs after every ``rect_interval``-th).
    fused: a step as one device program (``steps.decode_step``; None: by backend).
  """

  model: Any
  method: AttentionMethod
  history: jax.Array
  caches: Any
  states: Any
  sampling: Sampling = Sampling()
  pinned: tuple[jax.Array, jax.Array] | None = None
  steps: int = 0
  fused: bool | None = None

  def step(self, newest: np.ndarray, key) -> tuple[jax.Array, jax.Array]:
    """Decodes the window ending at positions ``newest [B]`` (the token fed in this step).

    Returns ``(next_token [B], logits [B, V] float32)``.
    """
    params, method = self.model.decode_params, self.method
    config = self.model.config.for_context(self.history.shape[1])
    pos = jnp.asarray(window_positions(newest, method.window))
    nxt, logits, self.history, self.caches, self.states = steps.decode_step(
        params, self.history, pos, self.caches, self.states, key, config=config,
        method=method, sampling=self.sampling, fused=self.fused)
    if self.pinned is not None:
      mask, tokens = self.pinned
      self.history = jnp.where(mask, tokens, self.history)
    self.steps += 1
    f = method.rect_interval
    if f and self.steps % f == 0:
      self.caches, self.states = steps.rectify_step(
          params, self.history, jnp.asarray(window_positions(newest, f)), self.caches,
          self.states, config=config, method=method)
    return nxt, logits


def pin_prefix(tokens: np.ndarray, capacity: int) -> tuple[jax.Array, jax.Array]:
  """The ``pinned`` argument that keeps ``tokens [B, N]`` at positions ``0 .. N-1``."""
  tokens = np.asarray(tokens, np.int32)
  b, n = tokens.shape
  full = np.zeros((b, capacity), np.int32)
  full[:, :n] = tokens
  return jnp.asarray(np.arange(capacity)[None] < n), jnp.asarray(full)
