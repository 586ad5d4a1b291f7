r"""Kept tokens of our compression methods against kvpress's presses, per layer and kv head.

  pip install --no-deps --target /tmp/kvp kvpress==0.5.5 cachetools
  python -m experiments.kvpress_parity --kvpress_path=/tmp/kvp --length=2048 --ratio=0.5

Not part of CI (kvpress is not a dependency). The embedded SmolLM2's post-RoPE keys and values
of a real text are captured once (a dense prefill, ``experiments.analysis.capture``); then per
press, per layer and kv head, the tokens our method keeps after ``end_prefill``'s scoring
(``keep_mask`` at ``ceil((1 - ratio) L)`` per head) are compared with the top-``n_kept`` of
kvpress's ``press.score`` on the same tensors (``compute_n_kept``), and the overlap
``|ours & theirs| / n_kept`` printed: its minimum, mean and the share of (layer, head) cells that
are identical. Only the presses that score from keys and values (no attention, no hidden
states) are compared here. kvpress 0.5.5 imports ``datasets`` and ``fire`` at package import for
presses this script does not use; they are stubbed when missing.

Measured 2026-11-27 (2,048 tokens of the essays, ratio 0.5, kvpress 0.5.5; mean / min overlap
over 30 layers x 3 kv heads): knorm 1.0000 / 0.9990 (one cell differs by one token at a float
near-tie), keydiff, cur 1 / 1 (every cell identical), lagkv 0.9983 / 0.9980 (LagKV's rank scores
tie across partitions, k / lag_size in each, and the cut falls inside such a tie: which of the
tied tokens stay is the top-k's tie order, torch's against ours: 2 of 1,024 kept tokens), random
0.50 (two generators: independent draws, as they should be).
"""

from __future__ import annotations

import math

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from experiments.analysis import capture
from experiments.common import modelzoo, peer_kvpress
from sparse_attn import methods

FLAGS = flags.FLAGS
# ours -> (kvpress class, its keyword options); the defaults of both sides unless named
PRESSES = {
    "knorm": ("KnormPress", {}),
    "keydiff": ("KeyDiffPress", {}),
    "cur": ("CURPress", {}),
    "lagkv": ("LagKVPress", {}),
    "random": ("RandomPress", {"seed": 0}),  # different generators: ~(1 - ratio) by design
}


def ours_kept(m, k, v, ratio):
  """``[K, S]`` bool: what method ``m`` keeps of one layer's ``k, v [K, S, D]``."""
  kh, s, d = k.shape
  cache = m.init_cache(1, kh, m.round_capacity(s), d)
  state = m.init_state(1, kh, kh, d, cache.capacity)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  q = jnp.zeros((1, kh, s, d), jnp.float32)  # the key/value scorers read no queries
  _, cache, state = m.prefill(q, jnp.asarray(k)[None], jnp.asarray(v)[None], cache, state, pos)
  n = jnp.full((1,), math.ceil((1 - ratio) * s), jnp.int32)
  return np.asarray(m.keep_mask(cache, state, None, n))[0, :, :s]


def theirs_kept(press, kvpress, k, v, ratio):
  import torch  # pylint: disable=g-import-not-at-top
  kt, vt = (torch.from_numpy(np.array(x, np.float32))[None] for x in (k, v))
  scores = press.score(None, None, kt, vt, None, {})
  n = kvpress.utils.compute_n_kept(k.shape[1], ratio)
  kept = np.zeros(k.shape[:2], bool)
  np.put_along_axis(kept, scores.topk(n, dim=-1).indices[0].numpy(), True, axis=-1)
  return kept


def main(argv):
  del argv
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  model = modelzoo.load_model("smollm2-135m-instruct")
  tokens = capture.text_tokens(model, FLAGS.text, FLAGS.length)
  cap = capture.capture(model, tokens)
  print(f"SmolLM2-135M, {FLAGS.length} tokens of {FLAGS.text!r}, ratio {FLAGS.ratio}, "
        f"kvpress {kvpress.version}")
  print("| ours | kvpress | min overlap | mean overlap | identical cells |\n|---|---|---|---|---|")
  for name in FLAGS.presses:
    cls, opts = PRESSES[name]
    m = methods.make(name, ratio=FLAGS.ratio)
    press = getattr(kvpress, cls)(compression_ratio=FLAGS.ratio, **opts)
    overlaps = []
    for layer in range(cap.num_layers):
      a = ours_kept(m, cap.k[layer], cap.v[layer], FLAGS.ratio)
      b = theirs_kept(press, kvpress, cap.k[layer], cap.v[layer], FLAGS.ratio)
      overlaps += list((a & b).sum(-1) / b.sum(-1))
    o = np.asarray(overlaps)
    print(f"| {name} | {cls} | {o.min():.4f} | {o.mean():.4f} | "
          f"{np.mean(o == 1.0):.1%} of {len(o)} |")


if __name__ == "__main__":
  flags.DEFINE_string("kvpress_path", "", "A folder holding kvpress (pip --target), if not "
                      "installed.")
  flags.DEFINE_integer("length", 2048, "Tokens of the text.")
  flags.DEFINE_float("ratio", 0.5, "Fraction evicted.")
  flags.DEFINE_string("text", "essays", "The text (experiments.common.data).")
  flags.DEFINE_list("presses", list(PRESSES), f"Which of {list(PRESSES)}.")
  app.run(main)
