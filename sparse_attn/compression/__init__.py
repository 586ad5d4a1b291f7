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

Modules: ``base`` (the shared per-layer schedule), ``compact`` (compaction into a smaller buffer),
``flat`` (the one-buffer-per-layer cache Ada-KV budgets compact into), ``head_budget`` (uniform
and Ada-KV allocation), ``observe`` (query buffers, partial attention), and one file per method.
"""

from sparse_attn.compression import (expected_attention, h2o, keydiff, knorm, snapkv,
                                     streaming_llm, tova)
from sparse_attn.compression.base import CompressionMethod, builder

# name -> build(spec, parts, options): validates every option (``base.builder``)
BUILDERS: dict = {cls.name: builder(cls) for cls in (
    expected_attention.ExpectedAttention, snapkv.SnapKV, tova.TOVA, keydiff.KeyDiff,
    knorm.KNorm, streaming_llm.StreamingLLM, h2o.H2O)}
