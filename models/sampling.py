"""Token sampling: greedy, temperature and nucleus (top-p, Holtzman et al. 2020)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Static sampling configuration.

  Attributes:
    temperature: 0 = greedy (argmax); otherwise logits are divided by it.
    top_p: keep the smallest set of tokens whose probability mass reaches ``top_p``.
    seed: PRNG seed of the generation.
  """

  temperature: float = 0.0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


GREEDY = Sampling()


def sample(logits, key, sampling: Sampling):
  """Draws one token per row.

  Args:
    logits: ``[B, V]`` float32.
    key: PRNG key.
    sampling: static configuration.

  Returns:
    ``[B]`` int32 token ids.
  """
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # mass strictly before each token; the first token is always kept
    before = jnp.cumsum(probs, axis=-1) - probs
    sorted_logits = jnp.where(before < sampling.top_p, sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
