"""KV-cache compression (permanent eviction) methods.

``BUILDERS`` maps a base spec name (e.g. ``"snapkv"``) to ``build(spec, parts, options) ->
method``: ``parts`` is ``spec.parse_spec(spec)`` and ``options`` the merged keyword options. The
returned object has the per-layer interface of ``sparse_attn.methods.Method``.
``methods.make`` dispatches here for every name in ``BUILDERS``:

  methods.make("snapkv", ratio=0.5)                       # one-shot after the prompt
  methods.make("expected_attention:phase=both", ratio=0.5, rope_theta=1e5)  # Ada-KV by default
  methods.make("h2o", ratio=0.75, head_budget="adakv")    # Ada-KV head-adaptive budgets
  methods.make("tova", ratio=0.5, scope="group")          # per-KV-group TOVA (paper: "layer")

Common options (``base.CompressionMethod``): ``ratio``, ``phase``, ``n_sink``, ``head_budget``,
``floor``, ``interval``, ``max_tokens``, ``decode_slots``, ``block_size``; each method adds its own.
``budget`` (the fraction of the context kept, as for a selector) may stand for ``ratio``, the
fraction evicted: ``make("snapkv", budget=0.1) == make("snapkv", ratio=0.9)`` (the built
method's spec says ``ratio``). Giving both at one level (both inline or both as keywords)
raises; a keyword overrides an inline one (``make("expected-attention", budget=0.1)``). A token
count (an int budget) raises: a compression method keeps a fraction of the context.

A method is one scorer; the head budget and the decode phase wrap it (kvpress's
``AdaKVPress`` / ``DecodingPress`` pattern). Modules:

* ``scorer``: the scoring contract a method implements (``observe``, ``scores``,
  ``compact_state``), one file per method beside it;
* ``head_budget``: ``HeadBudget``; the uniform and Ada-KV rules around a scorer (which slots a
  budget keeps);
* ``prefill``: the prompt's cut and the size of the compacted buffer at ``end_prefill``;
* ``decode_phase``: ``Phase``; ``DecodePhase``, the rule kept to a budget while generating;
* ``layout``: per-head (``KVCache``) or flat (``flat.FlatKVCache``, Ada-KV's one buffer per
  layer) caches behind one set of operations; ``flat`` and ``compact`` the buffers themselves;
* ``base``: ``CompressionMethod``, the per-layer interface composing these;
* ``observe`` (query buffers, partial attention) and ``rope`` (RoPE for the methods that model
  it): helpers of the scorers.
"""

import dataclasses

from sparse_attn import budget as budget_lib
from sparse_attn.compression import (cur, expected_attention, h2o, keydiff, knorm, lagkv,
                                     observed_attention, random_press, snapkv, streaming_llm,
                                     tova)
from sparse_attn.compression import compactor, qfilters
from sparse_attn.compression import chunkkv, criticalkv, finch, pyramidkv
from sparse_attn.compression.base import SIGNALS, CompressionMethod
from sparse_attn.compression import rocketkv
from sparse_attn.compression import duo_attention, kvzip
from sparse_attn.compression import think, think_composed
from sparse_attn.compression.decode_phase import Phase
from sparse_attn.compression.head_budget import HeadBudget
from sparse_attn.spec import check_options, with_options


def budget_as_ratio(spec: str, parts, options: dict):
  """``(spec, parts, options)`` with a ``budget`` (fraction kept) turned into ``ratio = 1 -
  budget`` (rounded to 6 digits), the spec string rewritten to say ``ratio``; unchanged without
  a ``budget``. ``parts[0]`` holds the inline options with the keyword ``options`` merged in
  (``methods.make`` writes them into the spec), so an inline key not among ``options`` was
  written inline. Raises ValueError for both at one level and for a token count."""
  (name, inline), rest = parts[0], parts[1:]
  written = {k for k in inline if k not in options}  # given inline only
  for level, keys in (("as keywords", set(options)), ("inline", written)):
    if {"budget", "ratio"} <= keys:
      raise ValueError(f"{name!r} takes budget (the fraction kept) or ratio (the fraction "
                       f"evicted), not both; got both {level} in {spec!r}")
  if "budget" not in inline:
    return spec, parts, options
  if "ratio" in options:  # a keyword ratio overrides the inline budget
    inline = {k: v for k, v in inline.items() if k != "budget"}
  else:
    b = budget_lib.parse_budget(inline["budget"])  # the ValueError of every entry point
    if isinstance(b, int):
      raise ValueError(f"{name} keeps a fraction of the context: give a budget in (0, 1], "
                       f"got the token count {b}")
    ratio = round(1.0 - b, 6)
    if "ratio" in inline:  # the keyword budget takes the place of the inline ratio
      inline = {k: ratio if k == "ratio" else v for k, v in inline.items() if k != "budget"}
    else:
      inline = {("ratio" if k == "budget" else k): (ratio if k == "budget" else v)
                for k, v in inline.items()}
  options = {k: v for k, v in options.items() if k not in ("budget", "ratio")}  # in inline
  parts = [(name, inline), *rest]
  return "+".join(with_options(n, o, {}) for n, o in parts), parts, options


def builder(cls):
  """``build(spec, parts, options)`` for ``compression.BUILDERS``: validates every option."""
  common = tuple(f.name for f in dataclasses.fields(CompressionMethod) if f.name != "spec")
  own = tuple(f.name for f in dataclasses.fields(cls)
              if f.name not in common + ("spec",) and f.repr)  # repr=False: set by the library

  def build(spec, parts, options):
    spec, parts, options = budget_as_ratio(spec, parts, options)
    (name, inline), rest = parts[0], parts[1:]
    if [n for n, _ in rest] == ["think"] and cls is not think.ThinK:  # press + ThinK
      press = build(with_options(name, inline, {}), parts[:1], options)
      return think_composed.compose(spec, press, rest[0][1])
    if rest:
      hint = "" if cls is think.ThinK else (f" (ThinK's key-channel pruning composes with "
                                            f"it: '{name}+think:ratio=0.5')")
      raise ValueError(f"compression method {name!r} takes no enhancers, got "
                       f"{[n for n, _ in rest]} in {spec!r}{hint}")
    opts = {**inline, **options}
    check_options(name, opts, common + own)
    return cls(spec=spec, **{**cls.DEFAULTS, **opts})

  build.__doc__ = f"Builds {cls.__name__} from a spec and options (see its docstring)."
  build.method_class = cls  # what methods.available() describes
  return build


# name -> build(spec, parts, options): validates every option (``builder``)
BUILDERS: dict = {cls.name: builder(cls) for cls in (
    expected_attention.ExpectedAttention, snapkv.SnapKV, tova.TOVA, keydiff.KeyDiff,
    knorm.KNorm, streaming_llm.StreamingLLM, h2o.H2O, observed_attention.ObservedAttention,
    random_press.RandomPress, cur.CUR, lagkv.LagKV, compactor.Compactor,
    qfilters.QFilters)}
BUILDERS.update({cls.name: builder(cls) for cls in (
    pyramidkv.PyramidKV, chunkkv.ChunkKV, finch.FINCH, criticalkv.CriticalKV,
    criticalkv.CriticalAdaKV)})
rocketkv.build.method_class = rocketkv.RocketKV
BUILDERS["rocketkv"] = rocketkv.build  # two stages from one token budget (its own builder)
BUILDERS[duo_attention.DuoAttention.name] = builder(duo_attention.DuoAttention)
BUILDERS[kvzip.KVzip.name] = builder(kvzip.KVzip)
BUILDERS[think.ThinK.name] = builder(think.ThinK)  # prunes key channels, not tokens
