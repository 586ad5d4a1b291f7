"""The enhancers' static configurations (frozen dataclasses, validated once at construction).

A ``methods.Method`` holds at most one of each: ``resa: Resa | None``, ``rect: Rectify | None``,
``retro: Retro | None``; ``configs(enh, opts)`` builds them from a spec's options.
"""

from __future__ import annotations

import dataclasses

from sparse_attn.enhancers import rectify as rect_lib
from sparse_attn.enhancers import resa as resa_lib
from sparse_attn.enhancers import retro as retro_lib

# enhancer -> its options (given inline, ``quest+resa:lam=0.5``, or as keywords to ``make``)
OPTIONS = {
    "resa": ("lam", "typical_query", "prior_update", "lam_form", "fused"),
    "rect": ("f",),
    "retro": ("w", "exposed"),
}


def _one_of(name: str, value, valid: tuple):
  if value not in valid:
    raise ValueError(f"{name} must be one of {valid}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Resa:
  """RESA residual estimation (Yang et al., ICLR 2026, Sec. 4).

  Attributes:
    lam: lambda in [0, 1], the weight of the estimated unselected keys (Sec. 4.3).
    lam_form: ``"renormalised"`` (default: the unselected mass is scaled by lam inside the
      softmax, so lam = 0 is exactly the selector alone) or ``"literal"`` (the paper's
      ``alpha' = lam * alpha`` in Eq. 5 with beta unchanged).
    typical_query: ``mu_Q``: the ``"mean"`` prompt query or the ``"last"`` one.
    prior_update: ``"prefill_only"`` (the paper's prior, fixed at the end of prefill) or
      ``"incremental"`` (an extension: decoded keys join the prior).
    fused: a decode step's prior update is one kernel launch and the aggregator's inputs are
      computed in the split combine's epilogue (where ``impl`` runs the kernels); False keeps
      both in XLA ops, the path before (issue 51), for timing one against the other.
  """

  lam: float = 1.0
  lam_form: str = "renormalised"
  typical_query: str = "mean"
  prior_update: str = "prefill_only"
  fused: bool = True

  def __post_init__(self):
    lam = self.lam
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1:
      raise ValueError(f"RESA lam must be a number in [0, 1] (Sec. 4.3), got {lam!r}")
    object.__setattr__(self, "lam", float(lam))
    _one_of("lam_form", self.lam_form, resa_lib.LAM_FORMS)
    _one_of("typical_query", self.typical_query, resa_lib.TYPICAL_QUERIES)
    _one_of("prior_update", self.prior_update, resa_lib.PRIOR_UPDATES)
    _one_of("fused", self.fused, (True, False))


@dataclasses.dataclass(frozen=True)
class Rectify:
  """ReSA dense rectification every ``f`` generated tokens (Sun et al. 2025, Sec. 2.2)."""

  f: int = rect_lib.DEFAULT_F

  def __post_init__(self):
    object.__setattr__(self, "f", rect_lib.interval(self.f))


@dataclasses.dataclass(frozen=True)
class Retro:
  """RetroAttention's window of ``w`` queries per decode step (Choi et al. 2025, Sec. 3).

  Attributes:
    w: the window (queries per step).
    exposed: where the keys each window query attended (Fig. 2c's effective budget) are
      counted: ``"kernel"`` (in the multi-query kernel's pass, from the masks it builds) or
      ``"xla"`` (XLA ops over every gathered slot of every window query, the path before; kept
      for timing one against the other on a GPU). The outputs are the same.
  """

  w: int = 2
  exposed: str = "kernel"

  def __post_init__(self):
    w = self.w
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= retro_lib.MAX_WINDOW:
      raise ValueError(f"retro window w must be an int in [1, {retro_lib.MAX_WINDOW}], got {w!r}")
    _one_of("exposed", self.exposed, retro_lib.EXPOSED_COUNTS)


def configs(enh, opts: dict) -> dict:
  """``Method`` fields ``resa``/``rect``/``retro`` of the enhancers ``enh`` from their options.

  ``rect`` with ``f = 0`` (never) and ``retro`` with ``w = 1`` are no enhancer at all (None).
  """
  pick = lambda e: {k: opts[k] for k in OPTIONS[e] if k in opts}
  out = {}
  if "resa" in enh:
    out["resa"] = Resa(**pick("resa"))
  if "rect" in enh:
    rect = Rectify(**pick("rect"))
    out["rect"] = rect if rect.f else None
  if "retro" in enh:
    retro = Retro(**pick("retro"))
    out["retro"] = retro if retro.w > 1 else None
  return out
