"""Method specs x budgets from a config -> labelled methods.

A config lists ``methods`` (spec strings) and ``budgets`` (fractions of the context kept). A
spec is the grammar of ``sparse_attn.methods.make`` (``sparse_attn.spec``: ``name:k=v+enhancer``,
paper presets included) and ``budget`` means what it means there, the fraction kept, for every
family (a compression method takes it as ``ratio = 1 - budget``, in ``methods.make``). Each
spec is crossed with every budget, except ``dense`` (no budget) and specs that fix their own
budget inline (``quest:budget=256``, ``quest:p=0.1``, ``snapkv:ratio=0.5``). Paper presets
(``sparse_attn.methods.PRESETS``) take inline overrides (``rectified:p=0.05``,
``expected-attention:eps=0``); a preset whose budget is a rule of its own (ReSA's ``p``,
RetroAttention's ``min_tokens``) is not crossed with the budgets, the others (``resa-quest``,
``expected-attention``) take each budget in place of theirs.

Experiment-only additions to the grammar (``methods.make`` knows none of them; ``parse`` splits
them off once, into a ``ParsedSpec``):

* ``+track`` / ``+reuse[:every=k]`` wrap a plain selector (``experiments.common.reuse``);
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
from sparse_attn import layer_inputs
from sparse_attn import methods
from sparse_attn.spec import parse_spec, parse_value

from experiments.common import calibration, checkpoint, modelzoo, reuse

_OWN_BUDGET = ("budget", "p", "ratio", "max_tokens")
_OWN_RULE = ("p", "min_tokens")  # a preset with one of these keeps its own budget rule
_WRAPPERS = ("track", "reuse")


@dataclasses.dataclass(frozen=True)
class ParsedSpec:
  """One spec string split once (``parse``) into what ``build`` and ``expand`` read.

  Attributes:
    text: the spec without its ``@b`` (an ``Entry``'s ``spec``).
    base: what ``methods.make`` builds: ``text`` without ``+track``/``+reuse``/``+calibrated``.
    family: the base method (``resa-quest`` -> ``quest``; ``base_name``).
    preset: the preset ``base`` names (``"rectified"``), else None.
    preset_options: the inline overrides of the preset, ``((key, value), ...)``.
    wrapper: ``"track"``, ``"reuse"`` or None; ``every``: its reuse interval (0: none).
    fit: ``+calibrated``'s directory, else None.
    at_budget: ``b`` of ``spec@b``, else None.
    own_budget: the spec keeps its own budget (dense, an inline budget, a preset's own rule).
  """

  text: str
  base: str
  family: str
  preset: str | None = None
  preset_options: tuple = ()
  wrapper: str | None = None
  every: int = 0
  fit: str | None = None
  at_budget: float | int | None = None
  own_budget: bool = False


def _split_calibrated(spec: str, parsed):
  """``"resa-quest+calibrated:fit=DIR"`` -> ``("resa-quest", "DIR")``; else ``(spec, None)``."""
  found = [i for i, (name, _) in enumerate(parsed) if name == "calibrated"]
  if not found:
    return spec, None
  i = found[0]
  opts = parsed[i][1]
  if len(found) > 1 or i != len(parsed) - 1 or set(opts) != {"fit"}:
    raise ValueError(f"+calibrated takes one option, fit=DIR, and comes last; got {spec!r}")
  return "+".join(spec.split("+")[:i]), str(opts["fit"])


def _split_wrappers(spec: str):
  """``"quest+reuse:every=2"`` -> ``("quest", "reuse", 2)``; no wrapper -> ``(spec, None, 0)``."""
  kept, wrapper, every = [], None, 0
  for raw, (name, opts) in zip(spec.split("+"), parse_spec(spec)):  # the one spec grammar
    if name not in _WRAPPERS:
      kept.append(raw)
      continue
    if set(opts) - {"every"}:
      raise ValueError(f"unknown option(s) {sorted(set(opts) - {'every'})} for +{name} in "
                       f"{spec!r}; valid: ['every']")
    wrapper, every = name, int(opts.get("every", 2 if name == "reuse" else 0))
  return "+".join(kept), wrapper, every


def parse(spec: str) -> ParsedSpec:
  """Splits ``spec`` (``base[+track|+reuse:every=k][+calibrated:fit=DIR][@b]``) once.

  Raises ValueError for a malformed spec: the grammar's errors, ``+calibrated`` not last or
  with other options, a wrapper option other than ``every``, enhancers after a preset, a bad
  ``@b``.
  """
  text, at, only = spec.partition("@")
  at_budget = budget_lib.parse_budget(parse_value(only)) if at else None
  without_fit, fit = _split_calibrated(text, parse_spec(text))
  base, wrapper, every = _split_wrappers(without_fit)
  parts = parse_spec(base)
  name, inline = parts[0]
  preset = name if name in methods.PRESETS else None
  if preset and len(parts) > 1:
    raise ValueError(f"a preset takes no enhancers after it, got {base!r}; give options "
                     f"inline ({name}:key=value)")
  made = parse_spec(methods.PRESETS[preset]) if preset else parts
  family = made[0][0]
  own = (family == "dense"
         or bool(preset) and any(k in _OWN_RULE for _, opts in made for k in opts)
         or any(k in _OWN_BUDGET for _, opts in parts for k in opts))
  return ParsedSpec(text=text, base=base, family=family, preset=preset,
                    preset_options=tuple(inline.items()) if preset else (), wrapper=wrapper,
                    every=every, fit=fit, at_budget=at_budget, own_budget=own)


def _parsed(spec) -> ParsedSpec:
  return spec if isinstance(spec, ParsedSpec) else parse(spec)


def base_name(spec) -> str:
  """The method family of a spec (``resa-quest`` -> ``quest``, ``expected-attention`` ->
  ``expected_attention``); ``spec``: a string or a ``ParsedSpec``."""
  return _parsed(spec).family


@dataclasses.dataclass(frozen=True)
class Entry:
  """One row of a comparison: ``label`` (``spec`` or ``spec@budget``), the budget, the method."""

  label: str
  spec: str
  budget: float | None
  method: object
  after_prefill: Callable | None = None  # states -> states, once after the prompt's prefill


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


def for_model(method, model):
  """``method`` with what it takes from ``model`` before a run: its RoPE frequencies
  (``with_rope``: methods that model RoPE) and its calibration tables
  (``calibration.calibrate``: Q-Filters' filters, DuoAttention's head scores; computed once per
  model and cached on disk). What a run adds per layer and sample (W^O, the question's length)
  reaches the method's layer state in ``models.steps.init_caches``
  (``sparse_attn.layer_inputs``)."""
  return calibration.calibrate(method.with_rope(modelzoo.rope_inv_freq(model)), model)


def build(spec, budget: float | None = None, *, rope_inv_freq=None, model=None, **options):
  """The method of ``spec`` (a string or a ``ParsedSpec``) at ``budget`` (fraction kept; None
  = the spec's ``@b``, else its own/default).

  ``budget`` goes through ``sparse_attn.budget.parse_budget`` (a whole number > 1 is a token
  count, ``1.5`` raises its ValueError) and then to ``methods.make`` as ``budget``, which a
  compression method takes as ``ratio = 1 - budget`` (a token count raises there).

  ``rope_inv_freq`` (the model's ``[D/2]`` RoPE frequencies) is given to methods that model
  RoPE (Expected Attention's pre-RoPE query statistics) unless the spec sets their own.
  ``model``: the model the method will run on (``for_model``: its RoPE frequencies and the
  method's calibration; a spec with ``calibration=prompt`` keeps its prompt fallback).
  """
  p = _parsed(spec)
  budget = p.at_budget if budget is None else budget
  opts = dict(p.preset_options, **options)
  if budget is not None and p.family != "dense":
    opts["budget"] = budget_lib.parse_budget(budget)
  m = methods.make(p.preset or p.base, **opts)
  if model is not None:
    m = for_model(m, model)
  elif rope_inv_freq is not None:
    m = m.with_rope(rope_inv_freq)
  if p.wrapper is not None:
    m = reuse.TrackedMethod.wrap(m, p.text if budget is None else f"{p.text}@{budget}", p.every)
  return m


def sized_for_question(entries, longest: Callable[[], int]) -> list[Entry]:
  """``entries`` with every method that buffers the prompt's question (FINCH's ring) sized for
  ``longest()`` tokens, the run's longest question (``sparse_attn.layer_inputs.sized_for``);
  ``longest`` is called only when such a method is there."""
  if not any(hasattr(e.method, "with_question_room") for e in entries):
    return list(entries)
  n = longest()
  return [dataclasses.replace(e, method=layer_inputs.sized_for(e.method, n)) for e in entries]


def bucketed(entries, bits: int | None) -> list[Entry]:
  """``entries`` with every compression method's compacted caches bucketed to ``bits``
  significant bits (``CompressionMethod.capacity_bits``; None: exact sizes); the rows keep
  their labels (the bits change how a cache is laid out, not what it holds)."""
  if bits is None:
    return list(entries)
  return [dataclasses.replace(e, method=e.method.with_capacity_bits(bits))
          if hasattr(e.method, "with_capacity_bits") else e for e in entries]


def has_own_budget(spec) -> bool:
  """Whether ``spec`` (a string or a ``ParsedSpec``) keeps its own budget (not crossed)."""
  return _parsed(spec).own_budget


def expand(specs, budgets, **options) -> list[Entry]:
  """Every spec crossed with every budget (see the module docstring), dense-like rows once.

  ``options`` go to ``build`` (e.g. ``block_size``, ``rope_inv_freq`` or ``model``).
  """
  out = []
  for spec in specs:
    p = parse(spec)
    if p.at_budget is not None:
      if p.own_budget:
        raise ValueError(f"{p.text!r} has a budget rule of its own; "
                         f"'@{spec.partition('@')[2]}' would not apply")
      b = p.at_budget
      rows = [(f"{p.text}@{b:g}", float(b), build(p, b, **options))]
    elif p.own_budget or not budgets:
      rows = [(p.text, None, build(p, None, **options))]
    else:
      rows = [(f"{p.text}@{b:g}", float(b), build(p, b, **options)) for b in budgets]
    out += [Entry(label, p.text, b, m, None if p.fit is None else
                  _head_params_after_prefill(p.text, m, p.fit)) for label, b, m in rows]
  return out
