"""TidalDecode's layers: a selection made in one layer, read by the layers after it.

``methods.make("tidaldecode", budget=0.1)`` builds a :class:`TidalMethod`, a ``methods.Method``
whose decoder layers differ (the paper, equations and defaults: ``selectors.tidal``). The
decode loop (``models.steps``) asks it for each layer's method (``for_layer``) and threads one
value through the layers of a decode step, the *relay*: None before the first selection
layer, then that layer's ``selection.Selection`` (token slots ``idx [B, Hq, k]``, ``n_valid
[B, Hq]``), replaced at the re-selection layer. A layer whose method has ``decode_relay``
decodes with it; every other method never sees the relay, so nothing changes for them.

* ``"dense"`` layers are a plain dense ``Method``: their cache and state are the same pytrees;
* ``"select"``: the new token's K/V written, dense attention (the paper's full attention), and
  the selector's top-k of the same query over the same keys becomes the relay;
* ``"reuse"``: the new K/V written, then the sparse flash-decoding kernel
  (``kernels.sparse_decode``) over this layer's keys at the relayed slots.

Slots are positions here (every layer writes token ``t`` at slot ``t``), so a selection of
slots in one layer names the same tokens in every other: the paper's "position persistence".
Prefill, ``end_prefill`` and ``rectify`` are dense, as for every selector method. The state
is the plain ``MethodState`` (nothing persists between steps: the relay lives for one step).

Not here: RESA, retro and rectification (refused), a sliding-window model (refused: the
selection layer would choose out-of-window tokens), context-parallel decoding.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pallas_kernels import check_softcap
from sparse_attn import kernels, placement, reference
from sparse_attn.method import Method

ROLES = ("dense", "select", "reuse")


@dataclasses.dataclass(frozen=True)
class TidalMethod(Method):
  """A ``Method`` with TidalDecode's layer roles (see the module docstring).

  Attributes:
    role: None for the model-wide method (``make``'s; ``for_layer`` gives each layer's), or
      ``"select"`` / ``"reuse"`` for a layer's.
  """

  role: str | None = None

  context_parallel: ClassVar[bool] = False

  def __post_init__(self):
    super().__post_init__()
    if self.role not in (None, "select", "reuse"):
      raise ValueError(f"role must be None, 'select' or 'reuse', got {self.role!r}")
    if self.resa or self.rect or self.retro:
      raise ValueError(f"{self.spec!r}: TidalDecode takes no enhancers (its selection layers "
                       "are dense; the others read their choice)")
    if self.dense_layers:
      raise ValueError(f"{self.spec!r}: TidalDecode's dense layers are the ones before its "
                       "sparse_start; give sparse_start instead of dense_layers")

  def for_layer(self, layer: int, num_layers: int | None = None) -> Method:
    """The method decoder layer ``layer`` (of ``num_layers``) runs: one object per role, so
    one compile each."""
    del num_layers  # a re-selection layer past the last layer never runs
    role = self.selector.role(layer)
    return self.dense_twin() if role == "dense" else dataclasses.replace(self, role=role)

  def full_layers(self, num_layers: int) -> int:
    """The dense layers and the selection layers (full attention, Sec. 3.2) of ``num_layers``."""
    return sum(self.selector.role(i) != "reuse" for i in range(num_layers))

  def with_sliding_window(self, window: int):
    raise NotImplementedError(f"{self.spec}: TidalDecode's selection layers would choose "
                              "tokens outside a sliding window; use a model without one")

  def with_softcap(self, softcap: float):
    """Caps every attention it runs; the per-head top-k ranks capped and uncapped logits
    alike (tanh is monotone), the group's mean (``gqa="group"``) does not: refused."""
    cap = check_softcap(softcap)
    if cap is not None and self.selector.group_shared:
      raise NotImplementedError(f"{self.spec}: a group's mean of uncapped logits ranks unlike "
                                "capped ones; use gqa='head'")
    return dataclasses.replace(self, softcap=cap)

  def decode(self, q, k, v, cache, state, positions, *, scale=None,
             place=placement.ONE_DEVICE):
    raise NotImplementedError(
        f"{self.spec}: TidalDecode's layers read the selection of an earlier layer; decode "
        "through models.steps (which calls for_layer and decode_relay per layer), or call "
        "decode_relay yourself")

  def decode_relay(self, q, k, v, cache, state, relay, positions, *, scale=None):
    """One decode step of this layer's role with the step's ``relay``.

    Args:
      q: ``[B, Hq, 1, D]``; k, v: ``[B, Hkv, 1, D]``; positions: ``[B, 1]`` (-1: padding).
      relay: the latest selection layer's ``Selection`` (ignored by a selection layer; None
        only before the first one).

    Returns:
      ``(out [B, Hq, 1, D], cache, state, relay)``: a selection layer returns its own choice.
    """
    if self.role is None:
      raise ValueError(f"{self.spec}: call for_layer(layer) first (the layer's role)")
    if q.shape[2] != 1:
      raise ValueError(f"{self.spec} decodes 1 query per step, got {q.shape[2]}")
    scale = reference.default_scale(q.shape[-1], scale)
    if self.role == "select":
      out, cache, state = self.dense_twin().decode(q, k, v, cache, state, positions, scale=scale)
      return out, cache, state, self.selector.select(q[:, :, 0], cache, scale)
    if relay is None:
      raise ValueError(f"{self.spec}: a reuse layer ran before any selection layer")
    cache = placement.ONE_DEVICE.store(cache, k.astype(cache.k.dtype), v.astype(cache.v.dtype),
                                       positions, positions, impl=self.impl,
                                       interpret=self.interpret)
    out, _ = kernels.sparse_decode(q[:, :, 0], cache, relay, scale, impl=self.impl,
                                   interpret=self.interpret, softcap=self.softcap,
                                   positions=positions[:, 0])
    return out[:, :, None].astype(q.dtype), cache, state, relay
