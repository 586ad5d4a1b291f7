"""Pinned teacher-forced logits of SmolLM2 under six methods (the orchestration-redesign guard).

``python -m tests.models.pinned_logits`` rewrites ``pinned_logits.npz``; the test
``test_pinned_logits.py`` recomputes and compares. Pinned per method and decode step: the argmax,
the log-sum-exp over the vocabulary and the logits of ``N_IDS`` fixed vocabulary ids.

``expected_attention`` was pinned again on 2026-11-29 (the others are unchanged): since then
``models.teacher_forced`` gives a method the model's RoPE (``decode.with_model_rope``), so
Expected Attention forms its pre-RoPE query statistics as the experiments always had it do
(``specs.for_model``), where the first pin had it without (post-RoPE statistics). Same argmax at
every step; the log-sum-exp moved by up to 7, and its mean distance to dense's fell from 3.66
to 3.31.
"""

from __future__ import annotations

import os

import numpy as np

PATH = os.path.join(os.path.dirname(__file__), "pinned_logits.npz")
PREFILL, TOTAL, N_IDS = 256, 280, 48
# name -> (spec, options): a 256-token context of 16 blocks, 4 chosen by score
METHODS = {
    "dense": ("dense", {}),
    "quest": ("quest", dict(budget=64)),
    "quest_resa": ("quest+resa", dict(budget=64)),
    "quest_rect": ("quest+rect:f=8", dict(budget=64)),
    "quest_retro": ("quest+retro:w=2", dict(budget=64)),
    "expected_attention": ("expected_attention", dict(ratio=0.5)),
}
TEXT = ("Sparse attention speeds up decoding by reading only the keys that matter. Quest keeps "
        "per-page bounding boxes of the keys and scores each page by an upper bound of the "
        "query-key product; the top pages are attended exactly. ")


def tokens(model) -> np.ndarray:
  """``[1, TOTAL]`` ids: the text repeated, numbered so that no two repeats are identical."""
  ids = []
  i = 0
  while len(ids) < TOTAL:
    ids += model.encode(f"Part {i}. {TEXT}")
    i += 1
  return np.asarray(ids[:TOTAL], np.int32)[None]


def summaries(model, spec: str, options: dict) -> dict:
  """``argmax [S]``, ``lse [S]`` and ``logits [S, N_IDS]`` of the teacher-forced steps."""
  import models  # pylint: disable=g-import-not-at-top
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top
  logits = models.teacher_forced(model, tokens(model), PREFILL, methods.make(spec, **options))
  logits = np.asarray(logits[0], np.float64)
  ids = np.random.default_rng(0).choice(logits.shape[-1], N_IDS, replace=False)
  m = logits.max(-1)
  lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
  return dict(argmax=logits.argmax(-1), lse=lse, logits=logits[:, ids])


def main():
  import models  # pylint: disable=g-import-not-at-top
  model = models.load("smollm2-135m-instruct")
  out = {}
  for name, (spec, options) in METHODS.items():
    for key, value in summaries(model, spec, options).items():
      out[f"{name}/{key}"] = value
    print(name, "done", flush=True)
  np.savez_compressed(PATH, **out)


if __name__ == "__main__":
  main()
