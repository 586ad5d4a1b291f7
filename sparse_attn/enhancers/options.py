"""Validation of the enhancers' options (``methods.make``): RESA, rectification, retro."""

from __future__ import annotations

from sparse_attn.enhancers import rectify as rect_lib
from sparse_attn.enhancers import resa as resa_lib
from sparse_attn.enhancers import retro as retro_lib


def fields(enh, opts: dict) -> dict:
  """``Method`` fields of the enhancers ``enh`` from their options, validated (paper ranges)."""
  out = {}
  if "resa" in enh:
    lam = opts.get("lam", 1.0)
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1:
      raise ValueError(f"RESA lam must be a number in [0, 1] (Sec. 4.3), got {lam!r}")
    form = opts.get("lam_form", "renormalised")
    if form not in resa_lib.LAM_FORMS:
      raise ValueError(f"lam_form must be one of {resa_lib.LAM_FORMS}, got {form!r}")
    tq = opts.get("typical_query", "mean")
    if tq not in resa_lib.TYPICAL_QUERIES:
      raise ValueError(f"typical_query must be one of {resa_lib.TYPICAL_QUERIES}, got {tq!r}")
    pu = opts.get("prior_update", "prefill_only")
    if pu not in resa_lib.PRIOR_UPDATES:
      raise ValueError(f"prior_update must be one of {resa_lib.PRIOR_UPDATES}, got {pu!r}")
    out.update(resa=True, lam=float(lam), lam_form=form, typical_query=tq, prior_update=pu)
  if "rect" in enh:
    out["rect_f"] = rect_lib.interval(opts.get("f", rect_lib.DEFAULT_F))
  if "retro" in enh:
    w = opts.get("w", 2)
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= retro_lib.MAX_WINDOW:
      raise ValueError(f"retro window w must be an int in [1, {retro_lib.MAX_WINDOW}], got {w!r}")
    out["retro_w"] = w
  return out
