r"""Kept tokens of our compression methods against kvpress's presses, per layer and kv head.

  pip install --no-deps --target /tmp/kvp kvpress==0.5.5 cachetools
  python -m experiments.kvpress_parity --kvpress_path=/tmp/kvp --length=2048 --ratio=0.5

Not part of CI (kvpress is not a dependency). The embedded SmolLM2's post-RoPE keys and values
of a real text are captured once (a dense prefill, ``experiments.common.capture``); then per
press, per layer and kv head, the tokens our method keeps after ``end_prefill``'s scoring
(``keep_mask`` at ``ceil((1 - ratio) L)`` per head) are compared with the top-``n_kept`` of
kvpress's ``press.score`` on the same tensors (``compute_n_kept``), and the overlap ``|ours &
theirs| / max(|ours|, |theirs|)`` printed (``kept_overlap.overlap``: 1 only for equal sets): its
minimum, mean and the share of (layer, head) cells that are identical. The presses that score
from keys and values get zero queries; those that read the observation window's attention
(SnapKV and its wrappers: ``kvpress_parity_window``) get the captured post-RoPE queries on our
side and, on kvpress's, the same window's causal softmax through the ``attentions`` argument of
``score`` (what its eager-attention path passes), a stand-in module with the model's sizes,
layer index and ``o_proj`` weight. FINCH's question is the text's last ``--question`` tokens
(kvpress: the tokens after its delimiter). kvpress 0.5.5 imports ``datasets`` and ``fire`` at
package import for presses this script does not use; they are stubbed when missing.

Measured 2026-11-27 (2,048 tokens of the essays, ratio 0.5, kvpress 0.5.5; mean / min overlap
over 30 layers x 3 kv heads): knorm 1.0000 / 0.9990 (one cell differs by one token at a float
near-tie), keydiff, cur 1 / 1 (every cell identical; 2026-11-29 also cur_random, kvpress's
``use_random_leverage`` with its ``torch.randn`` given our draw), lagkv 0.9983 / 0.9980
(LagKV's rank scores tie across partitions, k / lag_size in each, and the cut falls inside such
a tie: which of the tied tokens stay is the top-k's tie order, torch's against ours: 2 of 1,024
kept tokens), random 0.50 (two generators: independent draws, as they should be).

2026-12-07 (same text and ratio): knorm 1.0000 / 0.9980, two cells of layer 0 differ at float
near-ties (also at the previous head, 4e2a92c: the environment's rounding moved since
2026-11-27). merging_knorm (ours ``knorm:merge=true``, kvpress's ``MergingPress(KnormPress())``):
KNorm's kept sets, and the merged values within 1.9e-6 of kvpress's over the 88 cells that keep
the same tokens (0.041 in layer 0's two others, where another kept token takes merges);
merging_expected_attention (``MergingPress(ExpectedAttentionPress(epsilon=1e-2))``, ours with
uniform heads and ``eps=0.01``): every cell identical, values within 1.4e-6.

block_keydiff (2026-12-07, same text and ratio: ours ``keydiff:prompt_block=128``, kvpress's
``BlockPress(KeyDiffPress(), block_size=128)``, its leaderboard's): 1.0000 / 0.9980, 89 of 90
cells identical; in layer 7, kv head 1, two scores at the cut of the block from token 1,408
differ by 1.6e-8 (below float32's resolution at -0.89), our cut takes the other one and two of
1,024 kept tokens differ from there on (kvpress's set equals a float64 run of its loop).

StreamingLLM, TOVA (``kvpress_parity_window``: the last query's softmax) and Expected Attention
(2026-11-29, same text and ratio; ours ``head_budget=uniform, eps=0``, kvpress's defaults, where
the paper's Ada-KV and ``eps = 0.01`` are ours; kvpress's RoPE tables from the stand-in module's
``rotary_emb``): 1 / 1, every cell identical. kvpress's ``ObservedAttentionPress`` ("related to
H2O") is not our ``h2o``: it divides each key's summed attention by the number of queries that
see it and keeps no recent window, where H2O (the paper) sums and reserves half the budget for
the most recent tokens; it is our ``observed_attention`` (``kvpress_parity_window``).

Compactor (2026-11-29, same text and ratio, the overlap over the larger set): compactor_exact
(sketch R = D = 64 on both sides) 0.9883 / 0.9014, compactor (R = 48) 0.9292 / 0.8604,
adakv_compactor 0.9260 / 0.8727; no cell identical (torch's sketch is unseeded: each run differs
a little). The other rows above gave the same numbers again on 2026-11-29. The sketch is a
random draw on each side (torch's global generator, JAX's key) and, with kvpress's jitter
``1e-2`` on the sketched Gram matrix, even R = D leaves the leverage dependent on the draw;
kvpress also lets the last chunk's zero padding (2,036 middle tokens = 7 x 256 + 244) into its
softmax and sums, ours does not.
"""

from __future__ import annotations

import math
import types

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from experiments.common import capture, kept_overlap
from experiments.common import modelzoo, peer_kvpress
from experiments import kvpress_parity_window as window
from sparse_attn import methods

FLAGS = flags.FLAGS
# ours -> (kvpress class, its keyword options); the defaults of both sides unless named
PRESSES = {
    "knorm": ("KnormPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "cur": ("CURPress", {}),
    # kvpress's random-projection leverage, its torch.randn given our draw (same G both sides)
    "cur_random": ("CURPress", {"use_random_leverage": True}),
    "lagkv": ("LagKVPress", {}),
    "random": ("RandomPress", {"seed": 0}),  # different generators: ~(1 - ratio) by design
    "streaming_llm": ("StreamingLLMPress", {}),
    # kvpress's defaults: uniform heads, epsilon 0 (ours: the paper's Ada-KV and eps 0.01)
    "expected_attention": ("ExpectedAttentionPress", {}),
    # Compactor reads the prompt's queries and pre-RoPE keys (a stand-in attention module
    # below); its sketch is a random draw on each side (torch's, JAX's): at the default
    # R = 48 < D = 64 the leverages differ by design, at R = D both are exact
    "compactor": ("CompactorPress", {}),
    "compactor_exact": ("CompactorPress", {"sketch_dimension": 64}),
    "adakv_compactor": ("CompactorPress", {}),
    # kvpress's leaderboard's block_keydiff: BlockPress(KeyDiffPress(), block_size=128)
    "block_keydiff": ("KeyDiffPress", {}),
    # its merging_knorm / merging_expected_attention: MergingPress around the press (values
    # compared too: ``merged_values``)
    "merging_knorm": ("KnormPress", {}),
    "merging_expected_attention": ("ExpectedAttentionPress", {"epsilon": 1e-2}),
}
OURS = {"cur_random": ("cur", {"random_leverage": True}),
        "compactor": ("compactor", {"head_budget": "uniform"}),
        "compactor_exact": ("compactor", {"head_budget": "uniform", "sketch_dimension": 64}),
        "adakv_compactor": ("compactor", {}),
        "expected_attention": ("expected_attention", {"head_budget": "uniform", "eps": 0.0}),
        "block_keydiff": ("keydiff", {"prompt_block": 128}),
        "merging_knorm": ("knorm", {"merge": True}),
        "merging_expected_attention": ("expected_attention", {"head_budget": "uniform",
                                                              "eps": 0.01, "merge": True})}
BLOCKS = {"block_keydiff": 128}  # kvpress's BlockPress around the press, its block_size
ADAKV = {"adakv_compactor"}  # kvpress's AdaKVPress around the press (alpha_safeguard 0.2)
MERGING = {"merging_knorm", "merging_expected_attention"}  # kvpress's MergingPress around it
READS_QUERIES = {"compactor", "compactor_exact", "adakv_compactor", "expected_attention",
                 "merging_expected_attention"}


def ours_kept(m, k, v, ratio, q=None):
  """``[K, S]`` bool: what method ``m`` keeps of one layer's ``k, v [K, S, D]`` (and its
  queries ``q [N, S, D]``, for the methods that read them)."""
  cache, state = prefilled(m, k, v, q)
  s = k.shape[1]
  n = jnp.full((1,), math.ceil((1 - ratio) * s), jnp.int32)
  return np.asarray(m.keep_mask(cache, state, None, n))[0, :, :s]


def prefilled(m, k, v, q=None):
  """``(cache, state)`` of ``m`` after a dense prefill of one layer's ``k, v [K, S, D]`` (and
  queries ``q [N, S, D]``; zeros for the scorers that read none), batch 1."""
  kh, s, d = k.shape
  nq = kh if q is None else q.shape[0]
  cache = m.init_cache(1, kh, m.round_capacity(s), d)
  state = m.init_state(1, nq, kh, d, cache.capacity)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  q = jnp.zeros((1, kh, s, d), jnp.float32) if q is None else jnp.asarray(q)[None]
  _, cache, state = m.prefill(q, jnp.asarray(k)[None], jnp.asarray(v)[None], cache, state, pos)
  return cache, state


def merged_values(m, press, kvpress, k, v, ratio, q=None, inv_freq=None):
  """``(gap, tokens, other_gap)`` of one layer: the largest ``|ours - kvpress's|`` merged value
  over the kv heads where both keep the same tokens and how many tokens those hold, and the
  largest over the other heads (0 without any: there a different kept token moves merges).
  Ours: the compacted cache after ``end_prefill``; kvpress: ``MergingPress.compress``'s values,
  in the order of its top-k."""
  import torch  # pylint: disable=g-import-not-at-top
  kh, s, d = k.shape
  new, _ = m.end_prefill(*prefilled(m, k, v, q))
  ours = {}
  for h in range(kh):
    for slot in np.flatnonzero(np.asarray(new.valid)[0, h]):
      ours[(h, int(new.pos[0, h, slot]))] = np.asarray(new.v[0, h, slot])
  kt, vt = (torch.from_numpy(np.array(x, np.float32))[None] for x in (k, v))
  module, hidden, kwargs = ((types.SimpleNamespace(head_dim=d), None, {}) if q is None
                            else attention_stand_in(q, k, inv_freq))
  idx = press.press.score(module, hidden, kt, vt, None, kwargs).topk(
      kvpress.utils.compute_n_kept(s, ratio), dim=-1).indices[0].numpy()
  vals = press.compress(module, hidden, kt, vt, None, kwargs)[1][0].numpy()
  same, other, tokens = [0.0], [0.0], 0
  for h in range(kh):
    equal = {p for g, p in ours if g == h} == set(idx[h].tolist())
    tokens += len(idx[h]) if equal else 0
    (same if equal else other).extend(np.abs(ours[(h, int(i))] - vals[h, r]).max()
                                      for r, i in enumerate(idx[h]) if (h, int(i)) in ours)
  return max(same), tokens, max(other)


def theirs_kept(press, kvpress, k, v, ratio, q=None, inv_freq=None, adakv=False, draw=None):
  """``[K, S]`` bool: what kvpress's ``press`` keeps; ``draw``: the array its ``torch.randn``
  returns (our method's random projection, so both sides project alike)."""
  import torch  # pylint: disable=g-import-not-at-top
  kt, vt = (torch.from_numpy(np.array(x, np.float32))[None] for x in (k, v))
  module, hidden, kwargs = (None, None, {}) if q is None else attention_stand_in(q, k, inv_freq)
  n = kvpress.utils.compute_n_kept(k.shape[1], ratio)
  kept = np.zeros(k.shape[:2], bool)
  if isinstance(press, kvpress.MergingPress):  # it keeps what the press it wraps keeps
    press = press.press
  if isinstance(press, kvpress.BlockPress):  # no score: its compress gathers what it keeps,
    # here token ids in place of the values (the scorers it wraps read keys alone)
    ids = torch.arange(k.shape[1], dtype=torch.float32)[None, None, :, None].expand_as(vt)
    _, got = press.compress(module, torch.zeros(1, k.shape[1], k.shape[0]), kt,
                            ids.contiguous(), None, kwargs)
    np.put_along_axis(kept, got[0, ..., 0].long().numpy(), True, axis=-1)
    return kept
  randn = torch.randn
  if draw is not None:
    torch.randn = lambda *a, **kw: torch.from_numpy(np.array(draw, np.float32))
  try:
    scores = press.score(module, hidden, kt, vt, None, kwargs)
  finally:
    torch.randn = randn
  if adakv:  # AdaKVPress.compress: each head's top int(0.2 n) first, then one layer-wide cut
    scores = scores.clone()
    safe = max(1, int(n * 0.2))
    scores.scatter_(-1, torch.topk(scores, safe, dim=-1).indices, torch.finfo(scores.dtype).max)
    flat = torch.topk(scores.reshape(-1), k.shape[0] * n).indices.numpy()
    kept.reshape(-1)[flat] = True
    return kept
  np.put_along_axis(kept, scores.topk(n, dim=-1).indices[0].numpy(), True, axis=-1)
  return kept


def attention_stand_in(q, k, inv_freq):
  """A Llama-like attention module whose ``q_proj`` / ``k_proj`` read the pre-RoPE queries and
  keys back out of a stand-in hidden state, and the RoPE tables: what kvpress's
  ``get_prerope_*_states`` and ``position_embeddings`` give a press, for captured ``q [N, S, D]``
  and ``k [K, S, D]`` (post-RoPE)."""
  import torch  # pylint: disable=g-import-not-at-top
  from sparse_attn.compression import rope  # pylint: disable=g-import-not-at-top
  n, s, d = q.shape
  pos = jnp.arange(s)[None]
  pre_q, pre_k = (np.asarray(rope.rotate(jnp.asarray(x)[None], -pos, np.asarray(inv_freq)))[0]
                  for x in (q, k))
  flat = lambda x: torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 0, 1).reshape(s, -1)))
  hidden = torch.cat([flat(pre_q), flat(pre_k)], dim=-1)[None]
  cut = n * d

  class StandIn(torch.nn.Module):
    head_dim = d
    config = types.SimpleNamespace(num_attention_heads=n)

    def q_proj(self, h):
      return h[..., :cut]

    def k_proj(self, h):
      return h[..., cut:]

    def rotary_emb(self, x, position_ids):  # transformers' ``(cos, sin) [1, P, D]``
      return tables(position_ids[0].to(torch.float32))

  def tables(positions):
    angles = positions[:, None] * torch.tensor(inv_freq, dtype=torch.float32)[None]
    emb = torch.cat([angles, angles], dim=-1)[None]
    return emb.cos(), emb.sin()

  return StandIn(), hidden, {"position_embeddings": tables(torch.arange(s, dtype=torch.float32))}


def main(argv):
  del argv
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  model = modelzoo.load_model("smollm2-135m-instruct")
  tokens = capture.text_tokens(model, FLAGS.text, FLAGS.length)
  cap = capture.capture(model, tokens)
  print(f"SmolLM2-135M, {FLAGS.length} tokens of {FLAGS.text!r}, ratio {FLAGS.ratio}, "
        f"kvpress {kvpress.version}")
  print(kept_overlap.TABLE_HEAD)
  inv_freq = modelzoo.rope_inv_freq(model)
  for name in FLAGS.presses:
    if name in window.PRESSES:  # SnapKV and its wrappers: experiments/kvpress_parity_window.py
      o = window.overlaps(name, kvpress, model, cap, FLAGS.ratio, FLAGS.question)
      print(kept_overlap.table_row(name, window.PRESSES[name], o))
      if name == "finch":
        gap, same = window.finch_key_gap(kvpress, cap, FLAGS.ratio, FLAGS.question, inv_freq)
        print(f"finch re-rotated keys vs kvpress's (shifted by L - n): max |diff| {gap:.3g}; "
              f"values {'equal' if same else 'differ'}")
      continue
    cls, opts = PRESSES[name]
    spec, ours_opts = OURS.get(name, (name, {}))
    m = methods.make(spec, ratio=FLAGS.ratio, **ours_opts).with_rope(inv_freq)
    press = getattr(kvpress, cls)(compression_ratio=FLAGS.ratio, **opts)
    if name in BLOCKS:
      press = kvpress.BlockPress(press=press, block_size=BLOCKS[name])
    if name in MERGING:
      press = kvpress.MergingPress(press=press)

    # CUR's projection: kvpress's G = randn / sqrt(r) gets our G's unscaled draw
    draw = (np.asarray(m.projection(cap.k.shape[-1])) * math.sqrt(m.rank)
            if getattr(m, "random_leverage", False) else None)

    def kept_pair(layer, name=name, m=m, press=press, draw=draw):
      q = cap.q[layer] if name in READS_QUERIES else None
      return (ours_kept(m, cap.k[layer], cap.v[layer], FLAGS.ratio, q),
              theirs_kept(press, kvpress, cap.k[layer], cap.v[layer], FLAGS.ratio, q, inv_freq,
                          adakv=name in ADAKV, draw=draw))
    label = (f"BlockPress({cls}, {BLOCKS[name]})" if name in BLOCKS else
             f"MergingPress({cls})" if name in MERGING else cls)
    print(kept_overlap.table_row(name, label, kept_overlap.per_layer(cap.num_layers, kept_pair)))
    if name in MERGING:
      gaps = [merged_values(m, press, kvpress, cap.k[i], cap.v[i], FLAGS.ratio,
                            cap.q[i] if name in READS_QUERIES else None, inv_freq)
              for i in range(cap.num_layers)]
      print(f"{name}: merged values, max |ours - kvpress| {max(g[0] for g in gaps):.3g} over "
            f"the {sum(g[1] for g in gaps)} tokens of the heads that keep the same tokens; "
            f"{max(g[2] for g in gaps):.3g} in the others")


def define_flags(ratio_help: str = "Fraction evicted.") -> None:
  """The flags every kvpress parity script takes (kvpress's folder, the text, its length, the
  ratio), defined when a script runs."""
  flags.DEFINE_string("kvpress_path", "", "A folder holding kvpress (pip --target), if not "
                      "installed.")
  flags.DEFINE_integer("length", 2048, "Tokens of the text.")
  flags.DEFINE_float("ratio", 0.5, ratio_help)
  flags.DEFINE_string("text", "essays", "The text (experiments.common.data).")


if __name__ == "__main__":
  define_flags()
  flags.DEFINE_integer("question", 48, "FINCH: the last tokens taken as the question.")
  flags.DEFINE_list("presses", list(PRESSES) + list(window.PRESSES),
                    f"Which of {list(PRESSES) + list(window.PRESSES)}.")
  app.run(main)
