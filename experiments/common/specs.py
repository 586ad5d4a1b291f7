"""Method specs x budgets from a config -> labelled methods.

A config lists ``methods`` (spec strings for ``sparse_attn.methods.make``) and ``budgets``
(fractions of the context kept). Each spec is crossed with every budget, except:

* ``dense`` (no budget), and specs that fix their own budget inline (``quest:budget=256``,
  ``quest:p=0.1``);
* compression methods (``snapkv``, ``expected_attention``, ...) take ``ratio = 1 - budget``
  (the fraction evicted), so "budget 0.05" means the same kept fraction for every family;
* ``+track`` / ``+reuse[:every=k]`` wrap a plain selector (``experiments.common.reuse``);
* paper presets (``sparse_attn.methods.PRESETS``) are specs too, with inline overrides
  (``rectified:p=0.05``, ``expected-attention:eps=0``); a preset whose budget is a rule of its
  own (ReSA's ``p``, RetroAttention's ``min_tokens``) is not crossed with the budgets, the
  others (``resa-quest``, ``expected-attention``) take each budget in place of theirs;
* ``spec@b`` runs at budget ``b`` only (``resa-quest:lam=0.25@0.025``: one row, labelled and
  paired like the crossed ones);
* ``+calibrated:fit=DIR`` after a ``+resa`` spec with lambda 1 decodes with the per-head lambda
  (and bias slope) that ``experiments.resa_calibrate`` saved in ``DIR`` (an orbax directory,
  relative to the working directory; the spec grammar lowercases it and it may not hold
  ``+ , : = @``), set on every layer's state after the prefill (``Entry.after_prefill``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from sparse_attn import budget as budget_lib
from sparse_attn import compression, methods
from sparse_attn.spec import parse_spec, parse_value

from experiments.common import checkpoint, reuse

_OWN_BUDGET = ("budget", "p", "ratio", "max_tokens")
_OWN_RULE = ("p", "min_tokens")  # a preset with one of these keeps its own budget rule


def _preset(base_spec: str):
  """``("rectified", {"p": 0.05})`` when the spec's first part names a preset, else None."""
  parts = parse_spec(base_spec)
  name, inline = parts[0]
  if name not in methods.PRESETS:
    return None
  if len(parts) > 1:
    raise ValueError(f"a preset takes no enhancers after it, got {base_spec!r}; give options "
                     f"inline ({name}:key=value)")
  return name, inline


def base_name(spec: str) -> str:
  """The method family of a spec (``resa-quest`` -> ``quest``, ``expected-attention`` ->
  ``expected_attention``)."""
  base, _, _ = _split_wrappers(_split_calibrated(spec)[0])
  preset = _preset(base)
  return parse_spec(methods.PRESETS[preset[0]] if preset else base)[0][0]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One row of a comparison: ``label`` (``spec`` or ``spec@budget``), the budget, the method."""

  label: str
  spec: str
  budget: float | None
  method: object
  after_prefill: Callable | None = None  # states -> states, once after the prompt's prefill


def _split_calibrated(spec: str):
  """``"resa-quest+calibrated:fit=DIR"`` -> ``("resa-quest", "DIR")``; else ``(spec, None)``."""
  raws, parsed = spec.split("+"), parse_spec(spec)
  found = [i for i, (name, _) in enumerate(parsed) if name == "calibrated"]
  if not found:
    return spec, None
  i = found[0]
  opts = parsed[i][1]
  if len(found) > 1 or i != len(parsed) - 1 or set(opts) != {"fit"}:
    raise ValueError(f"+calibrated takes one option, fit=DIR, and comes last; got {spec!r}")
  return "+".join(raws[:i]), str(opts["fit"])


def _head_params_after_prefill(spec: str, method, fit: str):
  """``states -> states`` setting the per-head RESA parameters saved in ``fit``."""
  resa_opts = getattr(method, "resa", None)
  if not resa_opts or resa_opts.lam != 1 or resa_opts.lam_form != "renormalised":
    raise ValueError(f"{spec!r}: +calibrated needs a +resa method with lam = 1 in the "
                     "renormalised form (the fitted per-head lambda replaces the scalar one)")
  if not os.path.isdir(fit):
    raise ValueError(f"{spec!r}: no calibration at {os.path.abspath(fit)!r} (run "
                     "experiments.resa_calibrate; fit= names its calibration_<variant> folder)")
  from sparse_attn.enhancers import resa  # pylint: disable=g-import-not-at-top
  params = checkpoint.restore_arrays(fit)
  return lambda states: resa.set_head_params(states, params["log_lam"], params.get("beta"))


def _split_wrappers(spec: str):
  """``"quest+reuse:every=2"`` -> ``("quest", "reuse", 2)``; no wrapper -> ``(spec, None, 0)``."""
  kept, wrapper, every = [], None, 0
  for raw, (name, opts) in zip(spec.split("+"), parse_spec(spec)):  # the one spec grammar
    if name not in ("track", "reuse"):
      kept.append(raw)
      continue
    if set(opts) - {"every"}:
      raise ValueError(f"unknown option(s) {sorted(set(opts) - {'every'})} for +{name} in "
                       f"{spec!r}; valid: ['every']")
    wrapper, every = name, int(opts.get("every", 2 if name == "reuse" else 0))
  return "+".join(kept), wrapper, every


def build(spec: str, budget: float | None = None, *, rope_inv_freq=None, **options):
  """The method of ``spec`` at ``budget`` (fraction kept; None = the spec's own/default).

  ``budget`` goes through ``sparse_attn.budget.parse_budget``, the validation of
  ``methods.make``: a whole number > 1 is a token count, ``1.5`` raises its ValueError.

  ``rope_inv_freq`` (the model's ``[D/2]`` RoPE frequencies) is given to methods that model
  RoPE (Expected Attention's pre-RoPE query statistics) unless the spec sets their own.
  """
  base_spec, wrapper, every = _split_wrappers(_split_calibrated(spec)[0])
  name = base_name(base_spec)
  preset = _preset(base_spec)
  opts = dict(preset[1] if preset else {}, **options)
  if budget is not None and name != "dense":
    b = budget_lib.parse_budget(budget)  # the ValueError methods.make gives (1.5 is refused)
    if name in compression.BUILDERS:
      if isinstance(b, int):
        raise ValueError(f"{name} keeps a fraction of the context: give a budget in (0, 1], "
                         f"got the token count {b}")
      opts["ratio"] = round(1.0 - b, 6)
    else:
      opts["budget"] = b
  m = methods.make(preset[0] if preset else base_spec, **opts)
  if rope_inv_freq is not None:
    m = m.with_rope(rope_inv_freq)
  if wrapper is not None:
    m = reuse.TrackedMethod.wrap(m, spec if budget is None else f"{spec}@{budget}", every)
  return m


def has_own_budget(spec: str) -> bool:
  base, _, _ = _split_wrappers(_split_calibrated(spec)[0])
  if base_name(base) == "dense":
    return True
  preset = _preset(base)
  if preset and any(k in _OWN_RULE for _, inline in parse_spec(methods.PRESETS[preset[0]])
                    for k in inline):
    return True
  return any(k in _OWN_BUDGET for _, inline in parse_spec(base) for k in inline)


def expand(specs, budgets, **options) -> list[Entry]:
  """Every spec crossed with every budget (see the module docstring), dense-like rows once.

  ``options`` go to ``build`` (e.g. ``block_size``, ``rope_inv_freq``).
  """
  out = []
  for spec in specs:
    spec, at, only = spec.partition("@")
    if at:
      b = budget_lib.parse_budget(parse_value(only))
      if has_own_budget(spec):
        raise ValueError(f"{spec!r} has a budget rule of its own; '@{only}' would not apply")
      rows = [(f"{spec}@{b:g}", float(b), build(spec, b, **options))]
    elif has_own_budget(spec) or not budgets:
      rows = [(spec, None, build(spec, None, **options))]
    else:
      rows = [(f"{spec}@{b:g}", float(b), build(spec, b, **options)) for b in budgets]
    fit = _split_calibrated(spec)[1]
    out += [Entry(label, spec, b, m, None if fit is None else
                  _head_params_after_prefill(spec, m, fit)) for label, b, m in rows]
  return out
