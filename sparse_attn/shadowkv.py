"""The ``Method`` of ShadowKV's ``rank`` variant: the prompt's keys rebuilt at ``end_prefill``.

``selectors.ShadowKV(rank=r)`` decodes with this class (``methods.make("shadowkv", rank=r)``
builds it): a ``Method`` whose ``end_prefill`` replaces the prompt's keys outside the outlier
and local blocks by their rank-``r`` reconstruction from the pre-RoPE keys
(``ShadowKV.low_rank_keys``; Sun et al. 2024, Sec. 4.1), so every later decode step attends
rebuilt keys where ShadowKV does. It needs the model's RoPE frequencies (``with_rope``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from sparse_attn import placement
from sparse_attn.method import Method


@dataclasses.dataclass(frozen=True)
class ShadowKVMethod(Method):
  """A ``Method`` whose ``end_prefill`` rebuilds the keys from ShadowKV's low-rank store.

  Attributes (besides ``Method``'s):
    rope_inv_freq: the model's ``D/2`` RoPE inverse frequencies (``with_rope`` sets them).
  """

  rope_inv_freq: tuple | None = None

  prefill_group: ClassVar = None  # its end of the prompt differs from the dense group's
  context_parallel: ClassVar[bool] = False  # one SVD over every slot

  def with_rope(self, inv_freq) -> "ShadowKVMethod":
    """This method with the model's RoPE frequencies ``[D/2]``."""
    return dataclasses.replace(self, rope_inv_freq=tuple(float(f) for f in inv_freq))

  def end_prefill(self, cache, state, *, scale=None, place=placement.ONE_DEVICE):
    """``Method.end_prefill``, then the low-rank keys (``ShadowKV.low_rank_keys``)."""
    if self.rope_inv_freq is None:
      raise ValueError(f"{self.spec}: rank rebuilds the pre-RoPE keys and needs the model's "
                       "RoPE frequencies: method.with_rope(inv_freq)")
    cache, state = super().end_prefill(cache, state, scale=scale, place=place)
    return self.selector.low_rank_keys(cache, jnp.asarray(self.rope_inv_freq)), state
