"""The bytes a decode step of a named model shape must read (the shapes: ``models.shapes``).

Letters: B batch, L layers, E hidden, F MLP size, V vocab, N query heads, K kv heads, D head
dim, T context (tokens in the cache).

The shapes themselves (``SHAPES``, ``hf_config``, ``model_config``, ``random_model``) live in
``models.shapes`` and are re-exported here for the benchmark's modules. The bandwidth bound of a decode step (``step_bytes``) is every weight a step reads (each
layer's projections and MLP, the final norm and the LM head; of the embedding table only the B
rows looked up) plus the KV bytes the method reads (``traffic.fraction`` of dense attention's
``2 B K T D`` elements per layer), over the device's peak bandwidth.
"""

from __future__ import annotations

import math

from experiments.latency_lib import traffic
from models.shapes import SHAPES, hf_config, model_config, random_model  # pylint: disable=unused-import (re-exported)

def weight_bytes(config, batch: int = 1) -> dict:
  """Bytes of weights one decode step of ``batch`` rows reads, by part (analytic).

  Returns:
    ``dict(layers=, head=, embed_rows=, total=)``: every layer's projections, MLP, biases and
    (float32) norms (Qwen3's and Gemma 3's q/k norms, Gemma's two after attention and the MLP
    too); the final norm and the LM head (the ``[V, E]`` table when tied); the ``batch``
    embedding rows looked up.
  """
  e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
  q, kv = config.num_heads * d, config.num_kv_heads * d
  item = _itemsize(config.dtype)
  mats = e * q + 2 * e * kv + q * e + 3 * e * f
  bias = (q + 2 * kv) * config.qkv_bias + e * config.o_bias + (2 * f + e) * config.mlp_bias
  norms = 4 if config.sandwich_norms else 2  # Gemma: norms after attention and the MLP too
  layer = (mats + bias) * item + norms * e * 4 + 2 * d * 4 * config.qk_norm
  layers = config.num_layers * layer
  head = config.vocab_size * e * item + e * 4
  rows = batch * e * item
  return dict(layers=layers, head=head, embed_rows=rows, total=layers + head + rows)


def kv_bytes(method, config, *, context: int, batch: int) -> float:
  """KV-cache bytes one decode step of ``method`` reads over all layers at ``context`` tokens.

  ``traffic.fraction`` of dense attention's bytes, with the tokens a selection head attends
  taken from the method's budget (``Method.attended_tokens``); layers that attend everything
  (``dense_layers``, TidalDecode's) read dense's bytes. ``method=None``: dense (the peer's
  attention).
  """
  item = _itemsize(config.dtype)
  dense = traffic.dense_bytes(context, config.num_kv_heads, config.head_dim, item, batch)
  if method is None or method.is_dense:
    return float(config.num_layers * dense)
  acc = method.attended_tokens(context, config.num_layers)
  frac = traffic.fraction(method, context=context, selected_tokens=acc["total"],
                          num_q_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                          head_dim=config.head_dim, itemsize=item)
  full = acc.get("full_layers", 0)
  return float((full + (config.num_layers - full) * frac) * dense)


def bound(step_s: float, weights: float, kv: float, peak_gbs: float) -> dict:
  """The bandwidth bound of one step that read ``weights + kv`` bytes in ``step_s`` seconds.

  Returns:
    ``dict(bytes_per_step=, bound_ms=, bound_fraction=, bound_flag=)``: ``bound_fraction`` is
    bound time / measured time, in (0, 1] for a consistent measurement; None with a flag when
    no peak is known, and flagged when above 1 (the peak or the byte model is wrong).
  """
  total = weights + kv
  out = dict(bytes_per_step=total, bound_ms=None, bound_fraction=None, bound_flag=None)
  if not peak_gbs:
    out["bound_flag"] = "no peak bandwidth known for this device (set peak_bandwidth_gbs)"
    return out
  if not (step_s > 0 and math.isfinite(step_s)):
    out["bound_flag"] = "no valid time"
    return out
  bound_s = total / (peak_gbs * 1e9)
  out.update(bound_ms=bound_s * 1e3, bound_fraction=bound_s / step_s)
  if bound_s > step_s:
    out["bound_flag"] = "faster than the bound: peak bandwidth or byte model wrong"
  return out


def _itemsize(dtype: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
