r"""Cost of prefill compression's compaction (``end_prefill``) and the compacted cache's size.

  python -m experiments.compaction_bench --spec=snapkv --ratio=0.5 --head_budget=adakv

Prefills a random prompt of ``--context`` tokens on the model (default the embedded SmolLM2),
then times ``end_prefill`` over all layers twice: the first call includes compilation (one per
distinct compacted shape), the second is the steady state. Prints the cache bytes after
compaction next to a dense cache of the same prompt (``bytes / dense``).
With ``--decode_steps`` it also reports decode tokens/s of ``models.generate`` on the compacted
cache; with ``--question_tokens`` the time to read a question of that many tokens through the
compacted cache (the query-agnostic protocol) in one chunk (``decoding.extend``) and one decode
step per token (``decoding.extend_stepwise``), and their ratio. Timings are wall time on this
machine: a first call (compiles), then the steady state.
"""

from __future__ import annotations

import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
def define_flags() -> None:
  """The script's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_string("model", "smollm2-135m-instruct", "Model name, HF directory or tiny-random.")
  flags.DEFINE_string("spec", "snapkv", "Compression method spec.")
  flags.DEFINE_float("ratio", 0.5, "Fraction evicted.")
  flags.DEFINE_string("head_budget", "adakv", "uniform | adakv.")
  flags.DEFINE_integer("context", 1024, "Prompt tokens.")
  flags.DEFINE_integer("decode_room", 16, "Decode slots allocated past the prompt.")
  flags.DEFINE_integer("seed", 0, "Prompt seed.")
  flags.DEFINE_integer("question_tokens", 0, "If > 0, also time reading this many tokens after "
                       "compaction: one chunk vs one decode step per token.")
  flags.DEFINE_integer("decode_steps", 0, "If > 0, also time this many greedy decode steps "
                       "(after a warm-up generation with the same shapes).")


def _nbytes(caches) -> int:
  return sum(c.nbytes() for c in caches)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from experiments.common import modelzoo
  from models import decode, steps
  from sparse_attn import methods

  model = modelzoo.load_model(FLAGS.model)
  config = model.config
  rng = np.random.default_rng(FLAGS.seed)
  prompts = rng.integers(10, config.vocab_size - 10, (1, FLAGS.context)).astype(np.int32)
  lengths = np.array([FLAGS.context], np.int32)
  method = methods.make(FLAGS.spec, ratio=FLAGS.ratio, head_budget=FLAGS.head_budget)
  capacity = method.round_capacity(FLAGS.context + FLAGS.question_tokens + FLAGS.decode_room)

  # Prefill without end_prefill: the per-layer caches and states that end_prefill receives.
  real_end_prefill = decode.end_prefill
  decode.end_prefill = lambda c, s, **kw: (c, s)
  try:
    _, _, caches, states = decode.prefill(model, prompts, lengths, method, capacity)
  finally:
    decode.end_prefill = real_end_prefill
  dense_bytes = _nbytes(caches)
  for label in ("first (compiles)", "second"):
    copies = jax.tree.map(jnp.copy, (caches, states))
    jax.block_until_ready(copies)
    t0 = time.perf_counter()
    out_caches, out_states = steps.end_prefill(*copies, config=config, method=method)
    jax.block_until_ready(out_caches)
    print(f"end_prefill {label}: {time.perf_counter() - t0:.2f} s "
          f"({config.num_layers} layers)")
  shapes = sorted({tuple(c.k.shape) for c in out_caches})
  got = _nbytes(out_caches)
  print(f"{method.spec} ratio={FLAGS.ratio} head_budget={FLAGS.head_budget} "
        f"context={FLAGS.context}: cache {got / 2**20:.2f} MiB vs dense {dense_bytes / 2**20:.2f}"
        f" MiB = {got / dense_bytes:.3f}; {len(shapes)} distinct buffer shape(s) {shapes[:3]}")
  if FLAGS.question_tokens > 0:
    _time_question(model, method, out_caches, out_states, lengths, capacity, rng)
  if FLAGS.decode_steps > 0:
    cap = method.round_capacity(FLAGS.context + FLAGS.decode_steps)
    run = lambda n: decode.generate(model, prompts[0].tolist(), n, method, capacity=cap,
                                    stop_at_eos=False)
    run(2)  # warm-up: compiles the decode step at these shapes
    gen = run(FLAGS.decode_steps)
    print(f"decode: {gen.decode_tokens_per_second:.1f} tokens/s over {gen.decode_steps} steps")


def _time_question(model, method, caches, states, lengths, capacity, rng):
  """Times reading ``--question_tokens`` after compaction: chunk vs stepwise (fresh copies)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from experiments.tasks import decoding

  n = FLAGS.question_tokens
  question = rng.integers(10, model.config.vocab_size - 10, (1, n)).astype(np.int32)
  secs = {}
  for name, read in (("chunk", decoding.extend), ("stepwise", decoding.extend_stepwise)):
    for label in ("first (compiles)", "second"):
      pre = decoding.Prefilled(
          jnp.zeros((1, model.config.hidden_size)), jnp.zeros((1, capacity), jnp.int32),
          jax.tree.map(jnp.copy, caches), jax.tree.map(jnp.copy, states), lengths, capacity)
      jax.block_until_ready((pre.caches, pre.states))
      t0 = time.perf_counter()
      out = read(model, pre, method, question, np.array([n], np.int32))
      jax.block_until_ready(out.first)
      secs[name] = time.perf_counter() - t0
      print(f"question of {n} tokens, {name} {label}: {secs[name]:.2f} s")
  print(f"question read: stepwise / chunk = {secs['stepwise'] / secs['chunk']:.1f}x "
        "(steady state)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
