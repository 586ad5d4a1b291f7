r"""KVzip's kept tokens against kvpress 0.5.5's ``KVzipPress`` (outside CI).

  python -m experiments.kvpress_parity_kvzip --kvpress_path=/tmp/kvp --length=2048 --ratio=0.5
  python -m experiments.kvpress_parity_kvzip --kvpress_path=/tmp/kvp --chunk_size=512
  python -m experiments.kvpress_parity_kvzip --kvpress_path=/tmp/kvp --layerwise
  python -m experiments.kvpress_parity_kvzip --kvpress_path=/tmp/kvp --plus   # KVzip+

KVzip scores the prompt by running the model on a request to repeat it, so each side runs its
own model on the same ``--length`` tokens of the essays: ours the Flax SmolLM2
(``models.decode.prefill`` with ``kvzip``: prefill, ``models.kvzip_replay``, ``end_prefill``),
kvpress transformers' SmolLM2 (the same GGUF file, float32, sdpa) under ``with press(model)``.
kvpress's press reads ``AutoTokenizer.from_pretrained(name_or_path)``: stood in by transformers'
tokenizer of the GGUF file. Per layer and kv head, the kept tokens are compared (ours: the
cache's positions after ``end_prefill``; kvpress: the complement of the ``masked_key_indices``
that ``compress_post`` leaves on each attention module) and the overlap ``|ours & theirs| /
max(|ours|, |theirs|)`` printed (``kept_overlap.overlap``), min / mean over layers x kv heads;
also the replay token ids of both sides (checked equal) and the largest difference of the raw
scores (ours ``state["score"]`` before ``end_prefill``, kvpress's ``score_val``, the sinks
aside).

``--layerwise`` picks the selection on both sides: kvpress's default (``layerwise=False``, ours
too) ranks the scores of all layers and heads at once (ours: ``across_layers`` counts each
layer's share of the model's top entries before the layers are compressed); with
``layerwise=True`` both evict each layer's lowest ``K S ratio`` scores over all its heads. Either
way a head's count varies and 4 sinks are kept.

kvpress skips the chat template's prefix of the context (``prefix_length``: it assumes its
pipeline put the context in a user turn) and never scores it. This prompt is the raw text, as
in our runs and the other parity scripts, so kvpress's ``prefix_length`` is set to 0 inside the
``with`` block (before its replays); else its first ``prefix_length`` essay tokens would go
unscored. On a chat-formatted prompt ours scores the template's prefix too (a named difference,
``sparse_attn.compression.kvzip``). The replay text (``"\n\nRepeat the previous context
exactly."``, later chunks ``"... the part of ..., starting with"`` + the previous chunk's last 8
tokens), the assistant header after it, chunks of 2,048 from the prompt's start, the softmax over
sinks + chunk + the replay's own causal keys, the max over group and replay queries: as kvpress.

kvpress 0.5.5 pins transformers < 5.3, which passes the cache to attention as
``past_key_values=``; from 5.3 it is ``cache=``. So kvpress's ``forward_hook`` is handed the same
cache object under its old name too, and the prompt goes through ``model.model`` with
``past_key_values=`` (transformers maps it), where kvpress's wrapper reads it. Nothing else of
kvpress is changed.

Measured 2026-11-29, the default (one ranking over all layers; 2,048 tokens of the essays,
ratio 0.5, chunk 2,048): replay ids equal, scores within 2.2e-5 of kvpress's, both keep 92,160
entries in all and 1,183..5,526 per layer (a per-layer budget: 3,072 each), min / mean overlap
0.9992 / 1.0000, 88 of 90 (layer, kv head) cells identical: in layers 11 and 15 one token each
sits at the model-wide cut (kvpress's 2.9066678e-3) in a float near-tie (ours 2.9067697e-3 /
2.9066729e-3, kvpress 2.9063837e-3 / 2.9066678e-3), so one kept entry moved between layers.
Both modes measured again on 2026-11-29 with the overlap over the larger set
(``kept_overlap.overlap``): the same numbers.

Measured 2026-12-07 with ``--plus`` (KVzip+ on both sides, one ranking over all layers; 2,048
tokens of the essays, ratio 0.5, chunk 2,048; CPU, ~4 min): replay ids equal, scores within
8.4e-5 of kvpress's (the largest 17.4), both keep 92,160 entries in all and 450..5,912 per
layer, min / mean overlap 1.0000 / 1.0000, every (layer, kv head) cell identical.

Measured 2026-11-28 with ``--layerwise`` (then the only mode ours had; 2,048 tokens of the
essays, ratio 0.5, 30 layers x 3 kv heads; CPU, ~3.5 min): chunk 2,048 (one replay of 2,062 tokens, both sides' default): replay ids equal, scores
within 2.2e-5 of kvpress's, min / mean overlap 1.0000 / 1.0000, every cell identical. Chunk 512
(four replays; the later chunks' ``"... starting with"`` + 8 tokens): ids equal, scores within
1.6e-5, 0.9993 / 1.0000, 2 of 90 cells differ by one token: in layer 12 two (head, token)
entries straddle the layer-wide cut (kvpress's 1.2303856e-3) in opposite orders, a float
near-tie: ours 1.2303778e-3 / 1.2304032e-3, kvpress 1.2304051e-3 / 1.2303801e-3 (Flax and
torch differ by ~2.5e-8 there), so one kept token moved between heads. kvpress's
``prefix_length`` on this raw text would be 24 (SmolLM2's system turn); set to 0, as above.
"""

from __future__ import annotations

import math
import os

from absl import app, flags
import numpy as np

from experiments import kvpress_parity
from experiments import kvpress_parity_model
from experiments.common import capture, kept_overlap, modelzoo, peer_kvpress
from models import decode, kvzip_replay
from sparse_attn import methods

FLAGS = flags.FLAGS


def ours(model, tokens, ratio, chunk, layerwise, plus=False):
  """``(kept [L, K, S] bool, scores [L, K, S], replay ids per chunk)`` of our KVzip (KVzip+
  with ``plus``)."""
  s = len(tokens)
  m = methods.make(f"kvzip:chunk_size={chunk},layerwise={layerwise},plus={plus}", ratio=ratio)
  seen, replay = [], kvzip_replay.replay

  def spy(*args, **kwargs):
    caches, states = replay(*args, **kwargs)
    seen.append(np.stack([np.asarray(st["score"])[0, :, :s] for st in states]))
    return caches, states

  kvzip_replay.replay = spy
  try:
    *_, caches, _ = decode.prefill(model, np.asarray(tokens, np.int32)[None],
                                   np.asarray([s], np.int32), m, m.round_capacity(s))
  finally:
    kvzip_replay.replay = replay
  kept = np.zeros((len(caches), model.config.num_kv_heads, s), bool)
  for layer, c in enumerate(caches):  # flat layout (sparse_attn.compression.flat): a head per slot
    pos, head = np.asarray(c.pos)[0], np.asarray(c.head)[0]
    kept[layer, head[pos >= 0], pos[pos >= 0]] = True
  ids = [r[2] for r in kvzip_replay.replay_tokens(model.tokenizer, tokens, chunk)]
  return kept, seen[0], ids


def theirs(kvpress, tokens, ratio, chunk, layerwise, plus=False):
  """The same triple from kvpress's ``KVzipPress`` on transformers' model."""
  import torch  # pylint: disable=g-import-not-at-top
  from models import sources  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  path = sources.smollm2_path()
  tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                   gguf_file=os.path.basename(path))
  mod = kvpress.presses.kvzip_press
  mod.AutoTokenizer = type("GGUFTokenizer", (), {"from_pretrained": staticmethod(lambda _: tok)})
  model = kvpress_parity_model.torch_smollm2()
  press = kvpress.KVzipPress(compression_ratio=ratio, layerwise=layerwise, chunk_size=chunk,
                             kvzip_plus_normalization=plus)
  pairs, scores = [], []
  prepare, post = press.prepare, press.compress_post

  def spy_prepare(*args, **kwargs):
    pairs.extend(prepare(*args, **kwargs))
    return pairs

  def spy_post(m):
    scores.append(press.score_val[:, 0].float().clone().numpy())  # [L, K, S], before the sinks
    return post(m)

  hook = press.forward_hook  # transformers 5.3+ passes the cache as ``cache=``, 0.5.5 reads
  # ``past_key_values=`` (it pins transformers < 5.3): the same object under its old name
  press.forward_hook = lambda m, i, kw, out: hook(m, i, dict(kw, past_key_values=kw["cache"]), out)
  press.prepare, press.compress_post = spy_prepare, spy_post
  with torch.no_grad(), press(model):
    # model.model, as kvpress's pipeline does; ``past_key_values=`` as its hook reads it
    model.model(input_ids=torch.as_tensor(tokens, dtype=torch.long)[None],
                past_key_values=transformers.DynamicCache())
    print(f"kvpress prefix_length {press.prefix_length} -> 0 (raw text, no chat template)")
    press.prefix_length = 0
  cfg = model.config
  kept = np.ones((cfg.num_hidden_layers, cfg.num_key_value_heads, len(tokens)), bool)
  for layer in model.model.layers:
    _, head, seq = layer.self_attn.masked_key_indices
    kept[layer.self_attn.layer_idx, head.numpy(), seq.numpy()] = False
  return kept, scores[0], [r[0].tolist() for _, r in pairs]


def main(argv):
  del argv
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  model = modelzoo.load_model("smollm2-135m-instruct")
  tokens = capture.text_tokens(model, FLAGS.text, FLAGS.length)
  plus = f", kvzip_plus_normalization={FLAGS.plus}" if FLAGS.plus else ""
  press = f"KVzipPress(layerwise={FLAGS.layerwise}{plus})"
  a, sa, ids_a = ours(model, tokens, FLAGS.ratio, FLAGS.chunk_size, FLAGS.layerwise, FLAGS.plus)
  b, sb, ids_b = theirs(kvpress, tokens, FLAGS.ratio, FLAGS.chunk_size, FLAGS.layerwise,
                        FLAGS.plus)
  print(f"SmolLM2-135M, {FLAGS.length} tokens of {FLAGS.text!r}, ratio {FLAGS.ratio}, chunk "
        f"{FLAGS.chunk_size}, kvpress {kvpress.version} {press}")
  print(f"replay ids equal: {ids_a == ids_b} ({[len(i) for i in ids_a]} tokens per chunk)")
  d = np.abs(sa - sb)[..., 4:]
  print(f"scores: max |ours - kvpress| {d.max():.2e} (max score {sb[..., 4:].max():.3f}, "
        f"median {np.median(sb[..., 4:]):.2e}); kept per layer ours {a.sum((1, 2)).min()}.."
        f"{a.sum((1, 2)).max()}, kvpress {b.sum((1, 2)).min()}..{b.sum((1, 2)).max()} "
        f"(K ceil((1 - r) S) = {a.shape[1] * math.ceil((1 - FLAGS.ratio) * a.shape[2])}); "
        f"in all ours {a.sum()}, kvpress {b.sum()}")
  o = kept_overlap.overlap(a, b).reshape(-1)
  print(kept_overlap.TABLE_HEAD)
  print(f"RESULT | kvzip:layerwise={FLAGS.layerwise},plus={FLAGS.plus} | {press} | "
        f"{o.min():.4f} | {o.mean():.4f} | {np.mean((a == b).all(-1)):.1%} of {o.size} |")
  diff = np.argwhere(a != b)
  fmt = lambda x: " ".join(f"{y:.7e}" for y in x[:6])
  if len(diff):  # how close the disagreeing tokens' scores sit to the cut (a layer's, or all's)
    for layer in sorted(set(diff[:, 0]))[:FLAGS.show]:
      pool = sb[layer:layer + 1] if FLAGS.layerwise else sb
      ranked = np.concatenate([np.full(pool.shape[0] * pool.shape[1] * 4, np.inf),
                               pool[..., 4:].reshape(-1)])
      kept = b[layer].sum() if FLAGS.layerwise else b.sum()
      cut = np.sort(ranked)[::-1][kept - 1]  # the last kept, the 4 sinks first
      where = a[layer] != b[layer]
      print(f"  layer {layer}: {where.sum()} tokens differ; kvpress's cut {cut:.7e}, their "
            f"scores (ours / kvpress) {fmt(sa[layer][where])} / {fmt(sb[layer][where])}")


if __name__ == "__main__":
  kvpress_parity.define_flags()
  flags.DEFINE_integer("chunk_size", 2048, "Context tokens per replay (both sides' default).")
  flags.DEFINE_integer("show", 8, "Layers whose disagreeing tokens are described.")
  flags.DEFINE_bool("layerwise", False, "Each layer's own budget (kvpress's layerwise=True) "
                    "instead of one ranking over all layers (both sides' default).")
  flags.DEFINE_bool("plus", False, "KVzip+ on both sides (kvpress's kvzip_plus_normalization: "
                    "each weight times ||v W^O_h|| / ||x_s||).")
  app.run(main)
