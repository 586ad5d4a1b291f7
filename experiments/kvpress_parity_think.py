r"""ThinK's kept key channels against kvpress 0.5.5's ``ThinKPress`` on SmolLM2 (outside CI).

  python -m experiments.kvpress_parity_think --kvpress_path=/tmp/kvp --length=2048 --ratio=0.5

The post-RoPE queries and keys of a real text are captured once (a dense prefill,
``experiments.common.capture``); per layer, ours (``methods.make("think", ratio=r)``: prefill,
``end_prefill``, the cache's kept ``channels``) and kvpress's ``ThinKPress.compress`` (the
channels it zeroes, through ``kvpress_parity.attention_stand_in``, which hands it the window's
pre-RoPE queries and the RoPE tables) on the same arrays. Prints, over layers x kv heads, the
share of kvpress's kept channels that ours keeps and how many (layer, head) cells are identical.

Measured (2026-11-28, 2,048 tokens of the essays, channel ratio 0.5, 30 layers x 3 kv heads):
min / mean overlap 1.0000 / 1.0000, every cell identical (again on 2026-11-29 with the overlap
over the larger set, ``kept_overlap.overlap``).
"""

from __future__ import annotations

from absl import app, flags
import jax.numpy as jnp
import numpy as np

from experiments import kvpress_parity
from experiments.common import capture, kept_overlap, modelzoo, peer_kvpress
from sparse_attn import methods

FLAGS = flags.FLAGS


def ours_channels(m, q, k, v) -> np.ndarray:
  """``[K, D]`` bool: the key channels ThinK keeps of one layer (``q [N, S, D]``, ``k, v
  [K, S, D]`` post-RoPE)."""
  kh, s, d = k.shape
  cache = m.init_cache(1, kh, s, d)
  state = m.init_state(1, q.shape[0], kh, d, s)
  pos = jnp.arange(s, dtype=jnp.int32)[None]
  _, cache, state = m.prefill(jnp.asarray(q)[None], jnp.asarray(k)[None], jnp.asarray(v)[None],
                              cache, state, pos)
  cache, _ = m.end_prefill(cache, state)
  kept = np.zeros((kh, d), bool)
  np.put_along_axis(kept, np.asarray(cache.channels)[0], True, axis=-1)
  return kept


def theirs_channels(press, q, k, v, inv_freq) -> np.ndarray:
  """``[K, D]`` bool: the key channels kvpress's ``ThinKPress`` leaves non-zero."""
  import torch  # pylint: disable=g-import-not-at-top
  kt, vt = (torch.from_numpy(np.array(x, np.float32))[None] for x in (k, v))
  module, hidden, kwargs = kvpress_parity.attention_stand_in(q, k, inv_freq)
  kwargs = dict(kwargs, hidden_states=hidden)
  pruned, _ = press.compress(module, hidden, kt.clone(), vt, None, kwargs)
  # a pruned channel is zero at every position; a kept one almost surely is not
  return (pruned[0] != 0).any(dim=1).numpy()


def main(argv):
  del argv
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  model = modelzoo.load_model("smollm2-135m-instruct")
  cap = capture.capture(model, capture.text_tokens(model, FLAGS.text, FLAGS.length))
  inv_freq = modelzoo.rope_inv_freq(model)
  m = methods.make("think", ratio=FLAGS.ratio)
  press = kvpress.ThinKPress(key_channel_compression_ratio=FLAGS.ratio)
  o = kept_overlap.per_layer(cap.num_layers, lambda layer: (
      ours_channels(m, cap.q[layer], cap.k[layer], cap.v[layer]),
      theirs_channels(press, cap.q[layer], cap.k[layer], cap.v[layer], inv_freq)))
  print(f"SmolLM2-135M, {FLAGS.length} tokens of {FLAGS.text!r}, channel ratio {FLAGS.ratio}, "
        f"kvpress {kvpress.version}")
  print(kept_overlap.TABLE_HEAD)
  print(kept_overlap.table_row("think", "ThinKPress", o))

if __name__ == "__main__":
  kvpress_parity.define_flags("Fraction of key channels pruned.")
  app.run(main)
