"""Training-free sparse attention and KV-cache methods for LLM decoding (pure JAX).

Public modules: ``cache`` (KVCache pytree), ``reference`` (exact attention), ``merge``
(flash-decoding combine), ``budget``, ``scoring``, ``selection``, ``sparse`` (sparse decode, jnp), ``kernels`` (Pallas or jnp per op),
``methods`` (spec strings -> methods).
"""

from sparse_attn import (budget, cache, kernels, merge, methods, reference, scoring, selection,
                         sparse)
from sparse_attn.cache import KVCache, init_cache, write
from sparse_attn.merge import merge_n
from sparse_attn.methods import Method, make
from sparse_attn.reference import attention
from sparse_attn.selection import Selection
from sparse_attn.kernels import sparse_decode
