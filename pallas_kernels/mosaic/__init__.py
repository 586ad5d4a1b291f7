"""Pallas Mosaic GPU (Hopper: TMA, mbarriers) twins of the Triton kernels of ``pallas_kernels``.

Each op has its Triton twin's signature and is tested against the same jnp reference; run on the
CPU under Mosaic GPU's interpret mode (``interpret=True``: simulated shared memory, barriers, TMA,
race detection). docs/kernels_mosaic.md says what is and is not verified without a GPU.
"""

from pallas_kernels.mosaic._common import InterpretGPUParams
from pallas_kernels.mosaic.block_score import block_score
from pallas_kernels.mosaic.cache_append import cache_append
from pallas_kernels.mosaic.sparse_decode import dense_decode, sparse_decode
from pallas_kernels.mosaic.sparse_decode_multiquery import sparse_decode_multiquery
from pallas_kernels.mosaic.sparse_decode_resa import sparse_decode_resa

__all__ = ["InterpretGPUParams", "block_score", "cache_append", "dense_decode", "sparse_decode",
           "sparse_decode_multiquery", "sparse_decode_resa"]
