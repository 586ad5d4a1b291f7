"""Pallas (Triton) GPU kernels for sparse decoding, each beside its plain-jnp reference.

Every op takes ``impl: Impl = "auto" | "pallas" | "xla"`` (``auto``: Pallas on a GPU backend,
the jnp reference elsewhere; resolved by ``resolve_impl`` alone) and ``interpret`` (run the
kernel in Pallas interpret mode, e.g. on CPU). Each op's ``*_reference`` is the one jnp
implementation of it: the path ``impl="xla"`` runs and the one ``sparse_attn`` runs on a CPU.
This package never imports ``sparse_attn``; ``sparse_attn`` adapts its cache and selections to
these ops.
"""

from pallas_kernels._common import (IMPLS, Impl, TileConfig, attended_length,
                                    choose_num_splits, empty_padding_rows, gather_blocks,
                                    listed_slots_ok, order_after, resolve_impl)
from pallas_kernels.block_score import (block_score, block_score_pooled,
                                        block_score_pooled_reference, block_score_reference)
from pallas_kernels.block_select import (block_select, block_select_budgeted, block_select_ranked,
                                         block_select_reference)
from pallas_kernels.cache_append import cache_append, cache_append_reference
from pallas_kernels.chunk_attention import chunk_attention, chunk_attention_reference
from pallas_kernels.flat_decode import flat_decode, flat_decode_reference
from pallas_kernels.score_select import score_select, score_select_reference
from pallas_kernels.score_select import supported as score_select_supported
from pallas_kernels.softmax import (check_softcap, default_scale, grouped_attention,
                                    lse_combine, scaled_logits, soft_cap, softmax_sum)
from pallas_kernels.split_combine import split_combine, split_combine_pairs
from pallas_kernels.sparse_decode import (dense_decode, gather_listed, gather_prior,
                                          sparse_decode, sparse_decode_reference)
from pallas_kernels.sparse_decode_multiquery import (sparse_decode_multiquery,
                                                     sparse_decode_multiquery_reference,
                                                     window_slots_ok)
from pallas_kernels.sparse_decode_resa import sparse_decode_resa, sparse_decode_resa_reference
from pallas_kernels.resa_prior_update import resa_prior_update, resa_prior_update_reference

__all__ = [
    "IMPLS", "Impl", "TileConfig", "choose_num_splits", "resolve_impl", "gather_blocks",
    "listed_slots_ok", "order_after", "attended_length", "empty_padding_rows", "gather_listed", "gather_prior", "window_slots_ok",
    "check_softcap", "default_scale", "grouped_attention", "lse_combine", "scaled_logits",
    "soft_cap", "softmax_sum",
    "block_score", "block_score_pooled", "block_score_reference", "block_score_pooled_reference",
    "block_select", "block_select_budgeted", "block_select_ranked", "block_select_reference",
    "cache_append", "cache_append_reference",
    "chunk_attention", "chunk_attention_reference", "flat_decode", "flat_decode_reference",
    "score_select", "score_select_reference",
    "score_select_supported", "split_combine", "split_combine_pairs",
    "dense_decode", "sparse_decode", "sparse_decode_reference",
    "sparse_decode_resa", "sparse_decode_resa_reference",
    "resa_prior_update", "resa_prior_update_reference",
    "sparse_decode_multiquery", "sparse_decode_multiquery_reference",
]
