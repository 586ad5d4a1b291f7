"""Memory-traffic model of one decode step of one layer, as a fraction of dense attention.

Dense reads every key and value: ``2 Hkv T D`` elements. A block selector reads the block digests
(``kmin, kmax``: ``1/b`` of that) plus the selected blocks, once per selection head (per query
head with ``gqa="head"``: ``G`` times the group-shared amount); ReSA's rectification adds a dense
pass every ``f`` steps (``1/f``; Sun et al. 2025, Sec. 2.3); RESA adds the float32 prior logits
of the selected slots; token top-k reads every key and the selected values. RetroAttention's
``w - 1`` extra queries reuse the newest query's gathered blocks: same bytes, ``w`` x the
arithmetic. ``bound`` is ``1 / fraction``, the best speed-up a bandwidth-bound step can reach.
"""

from __future__ import annotations


def fraction(method, *, context: int, selected_tokens: float, num_q_heads: int,
             num_kv_heads: int, head_dim: int, itemsize: int) -> float:
  """Bytes read by ``method`` per step / bytes read by dense attention.

  Args:
    method: a ``sparse_attn.methods.Method``.
    context: tokens in the cache.
    selected_tokens: tokens listed per selection head (measured from the selection).
    num_q_heads, num_kv_heads, head_dim, itemsize: the attention shape and cache dtype size.
  """
  if method.is_dense:
    return 1.0
  p = selected_tokens / context
  heads = method.selection_heads(num_q_heads, num_kv_heads) / num_kv_heads  # KV reads per kv head
  if method.granularity == 1:  # token top-k: all keys (logits) + the selected values
    frac = 0.5 + 0.5 * p * heads
  else:
    frac = 1.0 / method.block_size + p * heads
  if method.resa:  # prior logits of the selected slots, f32, per query head
    frac += p * num_q_heads * 4 / (2 * num_kv_heads * head_dim * itemsize)
  if method.rect_interval:
    frac += 1.0 / method.rect_interval
  return frac


def dense_bytes(context: int, num_kv_heads: int, head_dim: int, itemsize: int,
                batch: int = 1) -> int:
  return 2 * batch * num_kv_heads * context * head_dim * itemsize


# Peak memory bandwidth (GB/s) by device name, most specific first (a name matches the first
# entry it contains): vendor data-sheet figures. "GH200" before "H200", the H100 variants
# before the SXM part's "H100".
PEAK_GBS = (("GH200", 4000.0), ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0),
            ("H100", 3350.0), ("A100-PCIE-40GB", 1555.0), ("A100", 2039.0))


def peak_gbs_for(device: str, configured: float = 0.0) -> tuple[float, str]:
  """``(GB/s, source)``: ``configured`` when > 0, else the data-sheet peak of ``device``'s
  name, else ``(0.0, "unknown")`` (no bound is computed then)."""
  if configured:
    return float(configured), "config"
  for name, gbs in PEAK_GBS:
    if name.lower() in device.lower():
      return gbs, f"data sheet ({name})"
  return 0.0, "unknown"
