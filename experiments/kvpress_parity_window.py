"""Kept tokens of SnapKV and its wrappers against kvpress 0.5.5 (``experiments.kvpress_parity``).

These presses read the observation window's attention. Our side prefills the captured post-RoPE
queries, keys and values of one layer and asks ``prefill_keep`` (the layer's budget included:
PyramidKV's ``for_layer``). kvpress's side gets the same window's causal softmax (float32,
``1/sqrt(D)``) through the ``attentions`` argument of ``score``, the slice
``attentions[..., -window:, :-window]`` that its eager path takes, and a stand-in module with
the model's sizes, the layer index and the layer's ``o_proj`` weight (CriticalKV). ChunkKV's
``compress`` refuses ``attentions``, so its inner SnapKV's ``score`` is bound to them instead
and the kept positions are read back from keys that carry their own index. FINCH's question
is the text's last ``question`` tokens, its window (kvpress finds them after a delimiter).

Measured 2026-11-28 and again 2026-11-29 with the overlap over the larger set
(``kept_overlap.overlap``; 2,048 tokens of the essays, ratio 0.5, question 48; min / mean over
30 layers x 3 kv heads): snapkv, pyramidkv, finch 1 / 1 (every cell identical; PyramidKV's
pyramid is in force at this length: ``k_max`` clamps to ``L - w = 1984`` and ``k_min`` to 64,
budgets 1,984 down to 64; at 4,096 tokens, 3,994 down to 102, also every cell identical);
chunkkv 0.9844 / 0.9844, no cell identical, by design: kvpress keeps whole chunks (51 of 20
tokens, one of them the last 8: 1,008 tokens), ours ``ceil((1 - r) L) = 1024``, the same chunks
and 16 tokens of the next (the old overlap over kvpress's set read 1 / 1); criticalkv 0.9990 /
1.0000 (one cell, one token: a float near-tie); criticaladakv 0.9896 / 0.9999 (two cells: the
layer-wide allocation moved a token between heads at a near-tie). TOVA (2026-11-29; kvpress's
score on the last query's softmax, window 1) and Ada-KV SnapKV (``snapkv:head_budget=adakv``
against ``AdaKVPress(SnapKVPress)``, the query-aware board's ``adakv_snapkv``; 2026-11-29): 1 /
1, every cell identical. Observed attention (2026-11-29; kvpress's score on every query's causal
softmax, the whole ``S x S`` matrix): 1 / 1, every cell identical.

FINCH's re-rotated keys (``finch_key_gap``, 2026-11-29, same text, ratio and question): ours,
rotated back by the shift ``L - n``, against kvpress's ``FinchPress.compress`` output keys over
all 30 layers: max ``|diff|`` 1.8e-4 (float32 rotations of keys up to ~20 in size; 17.8 with
``rerotate_keys=False``), kept values equal.
"""

from __future__ import annotations

import math
import types

import jax.numpy as jnp
import numpy as np

from experiments.common import kept_overlap
from sparse_attn import methods
from sparse_attn.compression import criticalkv, finch, rope

# ours -> kvpress's class (its leaderboard's configuration: defaults, SnapKV inside)
PRESSES = {"snapkv": "SnapKVPress", "pyramidkv": "PyramidKVPress", "chunkkv": "ChunkKVPress",
           "finch": "FinchPress", "criticalkv": "CriticalKVPress(SnapKVPress)",
           "criticaladakv": "CriticalAdaKVPress(SnapKVPress)", "tova": "TOVAPress",
           "adakv_snapkv": "AdaKVPress(SnapKVPress)",
           "observed_attention": "ObservedAttentionPress"}
OURS = {"adakv_snapkv": "snapkv:head_budget=adakv"}  # a name here -> our spec, if they differ
WINDOW = 64  # SnapKV's, kvpress's default


def window_attention(q, k, w):
  """``[1, N, w, S]`` torch float32: the last ``w`` queries' causal softmax over all keys."""
  import torch  # pylint: disable=g-import-not-at-top
  n, s, d = q.shape
  kk = np.repeat(k, n // k.shape[0], axis=0)
  z = torch.from_numpy(np.einsum("nwd,nsd->nws", q[:, -w:], kk) / math.sqrt(d))
  z = z + torch.triu(torch.full((w, s), float("-inf")), diagonal=s - w + 1)
  return torch.softmax(z.float(), dim=-1)[None]


def stand_in(cap, layer, wo):
  """What kvpress's presses read of an attention module (sizes, layer, ``o_proj``)."""
  import torch  # pylint: disable=g-import-not-at-top
  n, k, d = cap.q.shape[1], cap.k.shape[1], cap.q.shape[3]
  config = types.SimpleNamespace(num_attention_heads=n, num_key_value_heads=k, head_dim=d,
                                 hidden_size=wo.shape[-1], num_hidden_layers=cap.num_layers,
                                 _attn_implementation="sdpa")
  weight = torch.from_numpy(np.ascontiguousarray(wo.reshape(n * d, -1).T))  # [E, N D]
  return types.SimpleNamespace(config=config, layer_idx=layer, head_dim=d,
                               num_key_value_groups=n // k,
                               o_proj=types.SimpleNamespace(weight=weight))


def theirs(name, kvpress, cap, layer, wo, ratio, question):
  """``[K, S]`` bool: what kvpress 0.5.5 keeps of one layer."""
  import torch  # pylint: disable=g-import-not-at-top
  k, v = (torch.from_numpy(np.array(x[layer], np.float32))[None] for x in (cap.k, cap.v))
  s = k.shape[2]
  module, hidden = stand_in(cap, layer, wo), torch.zeros(1, s, 1)
  # TOVA: the last query's attention; observed attention: every query's (the whole matrix)
  w = {"finch": question, "tova": 1, "observed_attention": s}.get(name, WINDOW)
  attn = window_attention(np.asarray(cap.q[layer], np.float32), np.asarray(cap.k[layer]), w)
  kept = np.zeros((k.shape[1], s), bool)
  snap = kvpress.SnapKVPress(compression_ratio=ratio)
  n = kvpress.utils.compute_n_kept(s, ratio)
  if name == "chunkkv":
    snap.score = lambda *a: kvpress.SnapKVPress.score(snap, *a[:4], attn, a[5])
    index = torch.arange(s, dtype=torch.float32)[None, None, :, None].expand_as(k).clone()
    out, _ = kvpress.ChunkKVPress(press=snap).compress(module, hidden, index, v, None, {})
    kept[:, out[0, :, :, 0].long().numpy()[0]] = True
    return kept
  if name in ("criticaladakv", "adakv_snapkv"):
    press = (kvpress.CriticalAdaKVPress if name == "criticaladakv" else kvpress.AdaKVPress)(
        press=snap)
    press.compress(module, hidden, k, v, attn, {})
    _, heads, seq = module.masked_key_indices
    kept[:] = True
    kept[heads.numpy(), seq.numpy()] = False
    return kept
  if name == "finch":
    press = kvpress.FinchPress(compression_ratio=ratio)
    press.window_size = question
  else:
    press = {"snapkv": snap, "pyramidkv": kvpress.PyramidKVPress(compression_ratio=ratio),
             "criticalkv": kvpress.CriticalKVPress(snap),
             "tova": kvpress.TOVAPress(compression_ratio=ratio),
             "observed_attention": kvpress.ObservedAttentionPress(compression_ratio=ratio)}[name]
  if name == "pyramidkv":
    n = press.get_layer_budget(module, s)
  scores = press.score(module, hidden, k, v, attn, {})
  np.put_along_axis(kept, scores.topk(n, dim=-1).indices[0].numpy(), True, axis=-1)
  return kept


def ours(m, cap, layer, wo, question):
  """``[K, S]`` bool: what ``m`` keeps of one layer at the end of the prompt."""
  m = m.for_layer(layer, cap.num_layers)
  q, k, v = (jnp.asarray(x[layer], jnp.float32)[None] for x in (cap.q, cap.k, cap.v))
  _, nq, s, d = q.shape
  cache = m.init_cache(1, k.shape[1], m.round_capacity(s), d)
  state = m.init_state(1, nq, k.shape[1], d, cache.capacity)
  if m.name.startswith("critical"):
    state = criticalkv.set_out_proj(state, wo)
  if m.name == "finch":
    state = finch.set_question_length(state, question)
  _, cache, state = m.prefill(q, k, v, cache, state, jnp.arange(s, dtype=jnp.int32)[None])
  keep, _ = m.prefill_keep(cache, state)
  return np.asarray(keep)[0, :, :s]


def overlaps(name, kvpress, model, cap, ratio, question):
  """``[layers * K]`` ``kept_overlap.overlap`` per (layer, kv head)."""
  wo_all = np.asarray(model.params["layers"]["o_proj"]["kernel"], np.float32)  # [L, N D, E]
  n, d = cap.q.shape[1], cap.q.shape[3]
  opts = dict(window_size=max(question, 1)) if name == "finch" else {}
  m = methods.make(OURS.get(name, name), ratio=ratio, **opts)

  def kept_pair(layer):
    wo = wo_all[layer].reshape(n, d, -1)
    return (ours(m, cap, layer, wo, question),
            theirs(name, kvpress, cap, layer, wo, ratio, question))
  return kept_overlap.per_layer(cap.num_layers, kept_pair)


def finch_key_gap(kvpress, cap, ratio, question, inv_freq):
  """The largest ``|ours - kvpress|`` over every layer's re-rotated kept keys, and whether the
  kept values are equal: kvpress's ``FinchPress.compress`` (``rerotate_keys=True``, its default:
  keys at ``0 .. n-1``) on the window's attention, against our ``end_prefill`` (keys ending at
  ``L - 1``) rotated back by the common shift ``L - n``."""
  import torch  # pylint: disable=g-import-not-at-top
  m = methods.make("finch", ratio=ratio, window_size=max(question, 1)).with_rope(inv_freq)
  gap, same_values = 0.0, True
  for layer in range(cap.num_layers):
    q, k, v = (jnp.asarray(x[layer], jnp.float32)[None] for x in (cap.q, cap.k, cap.v))
    _, nq, s, d = q.shape
    cache = m.init_cache(1, k.shape[1], m.round_capacity(s), d)
    state = finch.set_question_length(m.init_state(1, nq, k.shape[1], d, cache.capacity),
                                      question)
    _, cache, state = m.prefill(q, k, v, cache, state, jnp.arange(s, dtype=jnp.int32)[None])
    cache, _ = m.end_prefill(cache, state)
    n = int(np.asarray(cache.valid)[0, 0].sum())
    module = stand_in(cap, layer, np.zeros((nq, d, 1), np.float32))
    module.rotary_emb = types.SimpleNamespace(inv_freq=torch.tensor(np.asarray(inv_freq)))
    press = kvpress.FinchPress(compression_ratio=ratio)
    press.window_size = question
    attn = window_attention(np.asarray(cap.q[layer], np.float32), np.asarray(cap.k[layer]),
                            question)
    tk, tv = press.compress(module, torch.zeros(1, s, 1), torch.from_numpy(np.array(k)),
                            torch.from_numpy(np.array(v)), attn, {})
    moved = rope.rotate_by(jnp.asarray(tk.numpy()), jnp.int32(s - n),
                           np.asarray(inv_freq, np.float32))
    gap = max(gap, float(np.max(np.abs(np.asarray(cache.k)[0, :, :n] - np.asarray(moved)))))
    same_values &= bool(np.array_equal(np.asarray(cache.v)[0, :, :n], tv.numpy()[0]))
  return gap, same_values
