"""The method registry: spec strings -> ``Method`` configs.

``make("quest", budget=0.05)`` returns a ``sparse_attn.method.Method`` (re-exported here), a
frozen hashable dataclass (a static argument under ``jax.jit``) whose per-layer functions are
pure (``prefill``, ``end_prefill``, ``decode``, ``rectify``, ``extend``; see ``method.py``).
``make("dense")`` is exact attention, the reference every other method is tested against;
``available()`` lists every name ``make`` builds (``catalog.MethodInfo``: family, panels).

Enhancers compose with any selector (``sparse_attn.enhancers``): ``"quest+resa"`` (RESA residual
estimation, option ``lam``, ``typical_query``, ``prior_update``), ``"quest+rect"`` (ReSA dense
rectification every ``f`` tokens), ``"quest+retro"`` (RetroAttention, window ``w``), in any
combination, e.g. ``"quest:gqa=group+resa:lam=0.5+rect:f=32+retro:w=4"``.
"""

from __future__ import annotations

from pallas_kernels import resolve_impl
from sparse_attn import compression, selectors
from sparse_attn.catalog import available  # pylint: disable=unused-import (methods.available)
from sparse_attn.enhancers import options as enhancer_options
from sparse_attn.method import Method
from sparse_attn.presets import PRESETS
from sparse_attn.spec import check_options, parse_spec, with_options

COMMON_OPTIONS = ("block_size", "impl", "interpret")
SELECTOR_METHOD_OPTIONS = ("dense_layers",)  # a selector method's own (``Method.dense_layers``)
ENHANCER_OPTIONS = enhancer_options.OPTIONS


def make(spec: str = "dense", **options) -> Method:
  """Builds a method from a spec string and options.

  Args:
    spec: ``"dense"``, a selector (``selectors.SELECTORS``: ``"quest"``, ``"arkvale"``,
      ``"topk"``, ``"streaming"`` and any ``selectors.register``-ed; options may also be given
      inline: ``"quest:gqa=group"``), a compression method, or a paper preset name (``PRESETS``: ``"resa-quest"``, ``"rectified"``, ``"retro"``, ...).
    **options: ``budget`` (float fraction in (0, 1] or int token count), ``p`` / ``n_min`` /
      ``n_local`` (ReSA's dynamic rule), ``n_sink``, ``local_window``, ``forced_count``
      (``extra``/``inside``, see ``sparse_attn.budget``), ``min_tokens``, ``gqa``, ``variant``,
      ``topp`` (adaptive top-p mass threshold) or ``adakv`` (Ada-KV per-head floor) for
      ``quest``/``arkvale``, ``block_size``, ``impl``, ``interpret``, ``dense_layers`` (a
      selector's first layers dense: ``"quest:dense_layers=2"``, Quest's own evaluation); with enhancers (``"quest+resa+rect+retro"``, each
      at most once, in any order, options inline ``"quest+resa:lam=0.5"`` or as keywords):
      ``lam`` (in [0, 1], default 1), ``lam_form`` (``renormalised``/``literal``),
      ``typical_query`` (``mean``/``last``), ``prior_update`` (``prefill_only``, the paper's
      default, or ``incremental``) for ``resa``; ``f`` (default 32; 0 or ``inf`` = never)
      for ``rect``; ``w`` (1..8, default 2) for ``retro``.

  Raises:
    ValueError: unknown names or options, or invalid values (the message lists valid ones).
  """
  if isinstance(spec, str) and spec.strip().lower() in PRESETS:
    spec = PRESETS[spec.strip().lower()]
  typed = spec  # what the caller wrote: an error quotes it, not the keyword options added
  if options:  # the built method's spec names its keyword options too
    spec = with_options(spec, options, ENHANCER_OPTIONS)
  parts = parse_spec(spec)
  (name, inline), rest = parts[0], parts[1:]
  if name in compression.BUILDERS:
    return compression.BUILDERS[name](spec, parts, options)
  base_names = ("dense",) + tuple(selectors.SELECTORS)
  if name not in base_names:
    valid = sorted(base_names + tuple(compression.BUILDERS))
    where = f" in {typed!r}" if str(typed).strip().lower() != name else ""
    raise ValueError(f"unknown method {name!r}{where}; valid: {valid}; presets: "
                     f"{sorted(PRESETS)}")
  enh, enh_opts = _parse_enhancers(spec, name, rest, options)
  opts = {**inline, **{k: v for k, v in options.items() if k not in enh_opts}}
  valid = COMMON_OPTIONS + (() if name == "dense" else (*SELECTOR_METHOD_OPTIONS,
                                                           *selectors.options(name)))
  valid += tuple(o for e in enh for o in ENHANCER_OPTIONS[e])
  check_options(name, opts, valid)
  impl = opts.get("impl", "auto")
  resolve_impl(impl)
  block_size = int(opts.get("block_size", 16))
  if block_size <= 0:
    raise ValueError(f"block_size must be positive, got {block_size}")
  common = dict(spec=spec, block_size=block_size, impl=impl,
                interpret=bool(opts.get("interpret", False)))
  if name == "dense":
    return Method(**common)
  sel = selectors.build(name, opts, block_size)  # TidalDecode's method_class: its layers
  return getattr(sel, "method_class", Method)(
      **common, selector=sel, **enhancer_options.configs(enh, enh_opts),
      dense_layers=opts.get("dense_layers", 0))


def _parse_enhancers(spec: str, name: str, rest, options: dict):
  """``[(enhancer, inline), ...]`` -> (enhancer names, their merged options)."""
  enh, enh_opts = [], {}
  for e, inline in rest:
    if e not in ENHANCER_OPTIONS:
      raise ValueError(f"unknown enhancer {e!r} in {spec!r}; valid: {sorted(ENHANCER_OPTIONS)}")
    if e in enh:
      raise ValueError(f"enhancer {e!r} given twice in {spec!r}")
    check_options(e, inline, ENHANCER_OPTIONS[e])
    enh.append(e)
    enh_opts.update(inline)
  if enh and name == "dense":
    raise ValueError(f"enhancers {enh} need a selector, not 'dense' ({spec!r}); valid "
                     f"selectors: {sorted(selectors.SELECTORS)}")
  for e in enh:  # keyword options of a present enhancer override inline ones, as for selectors
    for o in ENHANCER_OPTIONS[e]:
      if o in options:
        enh_opts[o] = options[o]
  return tuple(enh), enh_opts
