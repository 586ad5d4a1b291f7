"""Q-Filters: score keys by their projection on the queries' principal direction.

Godey et al., "Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression" (arXiv
2503.02812), Sec. 3. Letters: B batch, K kv heads, G group, N = K G query heads, T slots,
D head dim, L layers.

The (post-RoPE) queries of a head are anisotropic: most of them lie on one side of a single
direction ``u`` (their first right singular vector), so ``<q, k>`` is, in expectation over the
queries, an increasing function of ``<u, k>`` (Sec. 3, Eq. 4-5). The Q-Filter of a query head is
``f = -sign * v_1`` with ``Q = U S V^T`` the SVD of a sample of its queries on a calibration
text (uncentred) and ``sign = +1`` when most entries of ``U[:, 0]`` are positive (else -1), as
the authors' ``make_filters.py``; the filters of a kv head's group are averaged. A key's score
is ``-<f, k>`` (kvpress's ``QFilterPress``): the keys the queries will attend most are kept.
The calibration is a few thousand queries of a model's forward pass: no training, no gradient.

Where the filters come from (option ``calibration``):

* ``"text"``: one ``[K, D]`` filter per layer of a calibration text, given as a table
  ``[L][K][D]`` (``with_filters``; ``experiments.common.calibration.qfilters`` computes it from
  the model); each layer's state carries its row (``layer_state``: the model's ``init_caches``
  calls it with the layer index). The paper's protocol (its filters are per model, fixed).
* ``"prompt"`` (the fallback when no table is given): the filters of the prompt's own queries,
  from their uncentred second moment ``Q^T Q`` (its top eigenvector is ``v_1``), the sign that
  of the mean projection (the second moment keeps no per-query signs). Needs no calibration
  pass, at the cost of the paper's fixed filters.

Defaults: no sinks (kvpress's press keeps none), prefill and decode phases alike (kvpress's
``decoding_qfilter`` is the decode-phase variant).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sparse_attn.compression.base import CompressionMethod

CALIBRATIONS = ("text", "prompt")


def filters_from_queries(q, num_kv_heads: int, samples: int | None = 3000, seed: int = 0):
  """``[K, D]`` Q-Filters of queries ``q [N, S, D]`` (numpy; the authors' ``make_filters``).

  ``samples`` random queries (per head, the same ones; None = all) are decomposed per head:
  ``f_h = -sign_h v_1``, ``sign_h`` +1 when most ``U[:, 0]`` entries are positive; the group's
  filters are averaged.
  """
  q = np.asarray(q, np.float64)
  n, s, d = q.shape
  if samples is not None and samples < s:
    q = q[:, np.random.default_rng(seed).permutation(s)[:samples]]
  u, _, vh = np.linalg.svd(q, full_matrices=False)
  sign = np.where((u[..., 0] > 0).mean(-1) > 0.5, 1.0, -1.0)  # [N]
  f = -sign[:, None] * vh[:, 0]  # [N, D]
  return f.reshape(num_kv_heads, n // num_kv_heads, d).mean(1).astype(np.float32)


def filters_from_moments(second, mean, num_kv_heads: int):
  """``[B, K, D]`` filters of the queries' uncentred second moment ``[B, N, D, D]`` and mean
  ``[B, N, D]``: ``-sign(mean . v_1) v_1``, averaged over each group (``"prompt"``)."""
  _, vecs = jnp.linalg.eigh(second)
  v1 = vecs[..., -1]  # [B, N, D] top eigenvector
  sign = jnp.where(jnp.einsum("bnd,bnd->bn", v1, mean) >= 0, 1.0, -1.0)
  f = -sign[..., None] * v1
  b, n, d = f.shape
  return jnp.mean(f.reshape(b, num_kv_heads, n // num_kv_heads, d), axis=2)


@dataclasses.dataclass(frozen=True)
class QFilters(CompressionMethod):
  """Q-Filters eviction (Godey et al. 2025, Sec. 3): score ``-<f, k>``.

  Attributes:
    calibration: ``"text"`` (a per-model filter table, ``with_filters``) or ``"prompt"``.
      None: ``"text"`` when a table is given, else ``"prompt"``.
    filters: ``[L][K][D]`` nested tuple of the calibration text's filters (static; hashable).
  """

  calibration: str | None = None
  filters: tuple | None = None

  name = "qfilters"
  SIGNAL = "queries"  # keys projected on the queries' principal direction

  def __post_init__(self):
    super().__post_init__()
    if self.calibration is not None and self.calibration not in CALIBRATIONS:
      raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
    if self.filters is not None:
      object.__setattr__(self, "filters", _as_tuple(self.filters))
    if self.source == "text" and self.filters is None:
      raise ValueError("qfilters calibration='text' needs the filter table: "
                       "experiments.common.calibration.calibrate(method, model)")

  @property
  def source(self) -> str:
    return self.calibration or ("text" if self.filters is not None else "prompt")

  def with_filters(self, table):
    """This method with the calibration text's filters ``table [L, K, D]`` (spec unchanged)."""
    return dataclasses.replace(self, filters=_as_tuple(np.asarray(table, np.float32)))

  def init_extra(self, batch, num_q_heads, num_kv_heads, head_dim, capacity):
    if self.source == "text":
      return {"filter": jnp.zeros((batch, num_kv_heads, head_dim), jnp.float32)}
    return {"q_second": jnp.zeros((batch, num_q_heads, head_dim, head_dim), jnp.float32),
            "q_sum": jnp.zeros((batch, num_q_heads, head_dim), jnp.float32)}

  def layer_state(self, state, layer: int, inputs=None):
    """The state of layer ``layer``: its row of the filter table (``"text"``)."""
    del inputs  # the table is the method's (sparse_attn.layer_inputs)
    if self.source != "text":
      return state
    if not 0 <= layer < len(self.filters):
      raise ValueError(f"the filter table has {len(self.filters)} layers, asked for {layer}")
    f = jnp.asarray(self.filters[layer], jnp.float32)  # [K, D]
    if f.shape != state["filter"].shape[1:]:
      raise ValueError(f"filter table rows are {f.shape}, the layer has "
                       f"{state['filter'].shape[1:]} (kv heads, head dim)")
    return dict(state, filter=jnp.broadcast_to(f, state["filter"].shape))

  def observe(self, q, cache, state, positions, lse, scale):
    if self.source == "text":
      return state
    x = jnp.where((positions >= 0)[:, None, :, None], q.astype(jnp.float32), 0.0)
    return dict(state, q_second=state["q_second"] + jnp.einsum("bnsd,bnse->bnde", x, x),
                q_sum=state["q_sum"] + jnp.sum(x, axis=2))

  def layer_filters(self, state, num_kv_heads: int):
    """``[B, K, D]`` the filters this layer scores with."""
    if self.source == "text":
      return state["filter"]
    return filters_from_moments(state["q_second"], state["q_sum"], num_kv_heads)

  def scores(self, cache, state, scale, n):
    """``[B, K, T]``: ``-<f, k_t>`` (kvpress's ``QFilterPress.score``)."""
    del scale, n
    f = self.layer_filters(state, cache.k.shape[1])
    return -jnp.einsum("bktd,bkd->bkt", cache.k.astype(jnp.float32), f)


def _as_tuple(table):
  arr = np.asarray(table, np.float32)
  if arr.ndim != 3:
    raise ValueError(f"the filter table is [layers, kv heads, head dim], got shape {arr.shape}")
  return tuple(tuple(tuple(float(x) for x in row) for row in layer) for layer in arr)
