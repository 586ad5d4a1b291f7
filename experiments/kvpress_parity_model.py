r"""kvpress parity for the presses that run the whole model: DuoAttention on the fly.

  pip install --no-deps --target /tmp/kvp kvpress==0.5.5 cachetools
  python -m experiments.kvpress_parity_model --kvpress_path=/tmp/kvp

Not part of CI. kvpress's ``duo_attention_on_the_fly(model)`` runs on transformers' SmolLM2
(the same GGUF file, dequantised by transformers) with its two downloads stood in: BookSum
(``load_dataset``) by the pieces of the offline Austen text that
``experiments.common.calibration.duo_head_scores`` reads, and ``AutoTokenizer`` by their token
ids; ours runs on the Flax model. Printed: the largest difference of the two ``[L, K]`` head
score tables, whether the streaming heads agree at kvpress's leaderboard ratios, and the kept
prompt tokens' overlap per (layer, kv head) for a ``--length``-token prompt at ``--ratio``.

Measured 2026-11-28 (kvpress 0.5.5, 8 x 1,024 Austen tokens): head scores within 1.2e-7 of
kvpress's (range 0.014 .. 0.530); the streaming heads identical at ratios 0.25 / 0.5 / 0.75 /
0.875 (22 / 45 / 68 / 79 of 90); kept tokens at 2,048 tokens and ratio 0.5: overlap 1.0000
min and mean, all 90 (layer, kv head) cells identical (again on 2026-11-29, the overlap over
the larger set). KVzip is not compared here: kvpress's
press hooks transformers' attention modules during its own replay forward passes.
"""

from __future__ import annotations

import os
import types

from absl import app, flags
import numpy as np

from experiments.common import capture
from experiments.common import calibration, modelzoo, peer_kvpress
from sparse_attn.compression import duo_attention

FLAGS = flags.FLAGS


def torch_smollm2():
  import torch  # pylint: disable=g-import-not-at-top
  from models import sources  # pylint: disable=g-import-not-at-top
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  path = sources.smollm2_path()
  return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), dtype=torch.float32,
                                              gguf_file=os.path.basename(path)).eval()


def kvpress_duo_scores(kvpress, pieces):
  """kvpress's on-the-fly head scores ``[L, K]`` over ``pieces`` (token id arrays)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  mod = kvpress.presses.duo_attention_press
  names = [str(i) for i in range(len(pieces))]
  column = types.SimpleNamespace(tolist=lambda: names)  # what .sample(n)["chapter"] reads
  frame = types.SimpleNamespace(sample=lambda n, random_state: {"chapter": column})
  mod.load_dataset = lambda *a, **k: types.SimpleNamespace(to_pandas=lambda: frame)

  class Ids:  # AutoTokenizer stand-in: the piece's ids
    @staticmethod
    def from_pretrained(_):
      return lambda text, return_tensors: transformers.BatchEncoding(
          {"input_ids": torch.as_tensor(pieces[int(text)], dtype=torch.long)[None]})

  mod.AutoTokenizer = Ids
  model = torch_smollm2()
  return np.asarray(mod.duo_attention_on_the_fly(model, num_samples=len(pieces)))


def main(argv):
  del argv
  kvpress = peer_kvpress.load(FLAGS.kvpress_path)
  model = modelzoo.load_model("smollm2-135m-instruct")
  length, samples = 1024, 8  # calibration.duo_head_scores' defaults
  ours = calibration.duo_head_scores(model, length=length, samples=samples)
  tokens = capture.text_tokens(model, "austen", length * samples)
  theirs = kvpress_duo_scores(kvpress, [tokens[i * length:(i + 1) * length]
                                        for i in range(samples)])
  print(f"duo_attention_on_the_fly, SmolLM2-135M, {samples} x {length} Austen tokens, kvpress "
        f"{kvpress.version}: max |score diff| {np.abs(ours - theirs).max():.2e} "
        f"(scores {theirs.min():.3f} .. {theirs.max():.3f})")
  for r in (0.25, 0.5, 0.75, 0.875):
    a, b = (duo_attention.streaming_heads(t, r) for t in (ours, theirs))
    print(f"  ratio {r}: {int(b.sum())} streaming heads, {int((a != b).sum())} differ")
  a, b = (duo_attention.streaming_heads(t, FLAGS.ratio) for t in (ours, theirs))
  n, kept = FLAGS.length, min(FLAGS.length, 128 + 256)
  size = lambda s: np.where(s, kept, n)
  # |ours & theirs| / max(|ours|, |theirs|) (kept_overlap.overlap): a head that streams on one
  # side only keeps `kept` tokens there and all n on the other
  overlap = np.where(a != b, kept / n, 1.0)
  print(f"| duo_attention_on_the_fly | DuoAttentionPress(on_the_fly_scoring=True) | "
        f"{overlap.min():.4f} | {overlap.mean():.4f} | {np.mean(overlap == 1):.1%} of "
        f"{overlap.size} | (kept {size(a).sum()} vs {size(b).sum()} tokens at {n})")


if __name__ == "__main__":
  flags.DEFINE_string("kvpress_path", "", "A folder holding kvpress (pip --target).")
  flags.DEFINE_integer("length", 2048, "Prompt tokens for the kept-token overlap.")
  flags.DEFINE_float("ratio", 0.5, "Fraction of heads streaming.")
  app.run(main)
