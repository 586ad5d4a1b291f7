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

from sparse_attn.compression import (cur, expected_attention, h2o, keydiff, knorm, lagkv,
                                     random_press, snapkv, streaming_llm, tova)
from sparse_attn.compression.base import CompressionMethod
from sparse_attn.compression.decode_phase import Phase
from sparse_attn.compression.head_budget import HeadBudget

def builder(cls):
  """``build(spec, parts, options)`` for ``compression.BUILDERS``: validates every option."""
  common = tuple(f.name for f in dataclasses.fields(CompressionMethod) if f.name != "spec")
  own = tuple(f.name for f in dataclasses.fields(cls) if f.name not in common + ("spec",))

  def build(spec, parts, options):
    (name, inline), rest = parts[0], parts[1:]
    if rest:
      raise ValueError(f"compression method {name!r} takes no enhancers, got "
                       f"{[n for n, _ in rest]} in {spec!r}")
    opts = {**inline, **options}
    valid = sorted(common + own)
    bad = sorted(set(opts) - set(valid))
    if bad:
      raise ValueError(f"unknown option(s) {bad} for {name!r}; valid options: {valid}")
    return cls(spec=spec, **{**cls.DEFAULTS, **opts})

  build.__doc__ = f"Builds {cls.__name__} from a spec and options (see its docstring)."
  return build


# name -> build(spec, parts, options): validates every option (``builder``)
BUILDERS: dict = {cls.name: builder(cls) for cls in (
    expected_attention.ExpectedAttention, snapkv.SnapKV, tova.TOVA, keydiff.KeyDiff,
    knorm.KNorm, streaming_llm.StreamingLLM, h2o.H2O, random_press.RandomPress, cur.CUR,
    lagkv.LagKV)}
