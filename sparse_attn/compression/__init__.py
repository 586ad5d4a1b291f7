"""KV-cache compression (permanent eviction) methods.

``BUILDERS`` maps a base spec name (e.g. ``"snapkv"``) to ``build(spec, parts, options) ->
method``: ``parts`` is ``spec.parse_spec(spec)`` and ``options`` the merged keyword options. The
returned object has the per-layer interface of ``sparse_attn.methods.Method``.
``methods.make`` dispatches here for every name in ``BUILDERS``.
"""

BUILDERS: dict = {}
