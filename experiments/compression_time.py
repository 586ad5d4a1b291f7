r"""Compression time: what a compression method adds at the end of the prompt, timed per method.

  python -m experiments.compression_time --methods=chunkkv,chunkkv:reuse_layers=2
  python -m experiments.compression_time --model=qwen2.5-coder-0.5b-instruct --length=8192 \
      --methods=snapkv,chunkkv,chunkkv:reuse_layers=2,kvzip --out=/tmp/compression_time.jsonl

The model (default: the embedded SmolLM2-135M-Instruct) runs one prompt of ``--length`` random
tokens per method through ``models.decode.run_prompt`` (the chunked prefill with the method's
observations, and KVzip's replays), once; then ``models.steps.end_prefill`` on those caches
(the ``across_layers`` pass and each layer's scoring, kept set and compaction) is timed
round-robin over ``--repeats`` rounds after a compiling call (``timing.interleaved``). Each
method's median and its ratio to the first method's, measured in this run, are printed;
``--out`` appends one JSON line per method with the machine, JAX and revision.

The measure for ChunkKV's layer-wise index reuse (Liu et al. 2025, Sec. 3.3): only the first
layer of each group of ``reuse_layers`` scores the prompt, which the paper credits with about 20%
less compression time (and Table 8's +26.5% throughput at 8k on an A40, which includes the
decode).
"""

from __future__ import annotations

import json
import statistics

from absl import app, flags
import jax
import numpy as np

from experiments.common import modelzoo, results
from experiments.latency_lib import settings, timing
from models import decode, sources, steps
from sparse_attn import methods

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so the module imports cleanly)."""
  flags.DEFINE_string("model", sources.SMOLLM2, "A model modelzoo.load_model knows.")
  flags.DEFINE_string("methods", "chunkkv,chunkkv:reuse_layers=2", "Compression method specs; "
                      "the first is the ratios' reference.")
  flags.DEFINE_float("ratio", 0.5, "Fraction evicted (a spec's own ratio= wins).")
  flags.DEFINE_integer("length", 4096, "Prompt tokens.")
  flags.DEFINE_integer("repeats", 7, "Timed rounds (median).")
  flags.DEFINE_integer("seed", 0, "Prompt tokens' seed.")
  flags.DEFINE_string("out", "", "JSON-lines file for the rows (appended).")


def end_of_prompt(model, spec: str, ratio: float, length: int, seed: int) -> timing.Candidate:
  """``spec``'s ``end_prefill`` over one prefilled random prompt, as a timing candidate."""
  method = methods.make(spec, ratio=ratio) if "ratio=" not in spec else methods.make(spec)
  prompts = np.random.default_rng(seed).integers(
      10, model.config.vocab_size - 10, (1, length)).astype(np.int32)
  lengths = np.array([length], np.int32)
  capacity = length + 16
  _, _, caches, states = decode.run_prompt(model, prompts, lengths, method, capacity)
  config = model.config.for_context(capacity)

  def fn():
    return jax.block_until_ready(steps.end_prefill(caches, states, config=config,
                                                   method=method))
  return timing.Candidate(spec, fn)


def main(argv):
  del argv
  specs = settings.split_list(FLAGS.methods)
  if not specs:
    raise ValueError("--methods is empty")
  model = modelzoo.load_model(FLAGS.model)
  print(f"{FLAGS.model}, {model.config.num_layers} layers, prompt {FLAGS.length} tokens, "
        f"ratio {FLAGS.ratio}, {jax.default_backend()}", flush=True)
  cands = [end_of_prompt(model, s, FLAGS.ratio, FLAGS.length, FLAGS.seed) for s in specs]
  timing.interleaved(cands, warmup=1, repeats=FLAGS.repeats)
  first = statistics.median(cands[0].times)
  out = open(FLAGS.out, "a") if FLAGS.out else None
  for c in cands:
    ms = statistics.median(c.times) * 1e3
    print(f"{c.name}: {ms:.1f} ms (compile + first call {c.first_s:.1f} s), "
          f"x{ms / (first * 1e3):.3f} of {cands[0].name}", flush=True)
    if out:
      out.write(json.dumps(dict(section="compression_time", model=FLAGS.model,
                                length=FLAGS.length, ratio=FLAGS.ratio, method=c.name,
                                ms=ms, times_s=c.times, reference=cands[0].name,
                                over_reference=ms / (first * 1e3), git=results.git_revision(),
                                machine=results.machine(), jax=jax.__version__)) + "\n")
  if out:
    out.close()


if __name__ == "__main__":
  define_flags()
  app.run(main)
