"""Training-free sparse attention and KV-cache methods for LLM decoding (pure JAX).

Public modules: ``cache`` (KVCache pytree), ``reference`` (exact attention), ``merge``
(flash-decoding combine), ``budget``, ``scoring``, ``selection``, ``sparse`` (sparse decode,
jnp), ``kernels`` (Pallas or jnp per op), ``selectors`` (which entries a step attends: a
registry open like the compression methods), ``placement`` (one device or a shard),
``methods`` (spec strings -> methods: a selector plus enhancers), ``protocol`` (the per-layer
interface every method implements).

Shape letters, one table for ``sparse_attn``, ``models`` and ``pallas_kernels`` (a module's own
``Letters:`` line may add local ones but never redefines these):

  B  batch                        K  kv heads (``Hkv`` in the public contracts)
  N  query heads (``Hq``), N = K G  G  query heads per kv head
  H  selection heads: K when group-shared, N per query head
  S  queries per head in a call: a prefill chunk, the retro window ``w`` in decode
  T  cache slots (the capacity)   NB blocks, T // block_size
  n  entries listed in a selection  g  granularity (tokens per entry: block_size or 1)
  D  head dim                     E  hidden size, V vocabulary, L layers, W decode window
  Tf slots of a flat (Ada-KV) buffer; C a compacted capacity; M blocks touched by a write
  Kernels: P program heads, R rows per program, NS splits, J blocks per iteration.
"""

from sparse_attn import (budget, cache, kernels, merge, methods, reference, scoring, selection,
                         selectors, sparse)
from sparse_attn.cache import KVCache, init_cache, write
from sparse_attn.merge import merge_n
from sparse_attn.methods import Method, make
from sparse_attn.reference import attention
from sparse_attn.selection import Selection
from sparse_attn.kernels import sparse_decode
