r"""Generate with a sparse-attention method next to dense attention, with tokens/s.

  python -m experiments.generate --prompt="Explain sparse attention." --method=quest --budget=0.1

``--mesh=data:2,model:2,seq:2`` runs both on a device mesh (``--distributed`` first calls
``jax.distributed.initialize()``, see ``experiments/common/distributed.py``).

Flags pick the model (default: the embedded SmolLM2-135M-Instruct), the method spec (any string
``sparse_attn.methods.make`` accepts) and its budget. Timings exclude compilation: each run is
preceded by a short warm-up with the same shapes.
"""

from __future__ import annotations

import textwrap

from absl import flags

from experiments.common import cli, distributed

FLAGS = flags.FLAGS
distributed.define_flags()  # --mesh=data:2,model:2,seq:2, --distributed
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model name or HF directory.")
flags.DEFINE_string("prompt", "Explain in a few sentences why the sky is blue.", "Prompt text.")
flags.DEFINE_string("prompt_file", None, "Read the prompt from this file instead.")
flags.DEFINE_bool("chat", True, "Wrap the prompt in the model's chat template.")
flags.DEFINE_string("method", "quest", "Method spec, e.g. quest, arkvale, topk, streaming.")
flags.DEFINE_float("budget", None, "Budget: fraction of the context if <= 1, else tokens.")
flags.DEFINE_integer("block_size", 16, "Cache block (page) size.")
flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("prefill_chunk", 512, "Prompt chunk length.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params/compute dtype.")
flags.DEFINE_integer("width", 60, "Column width of the side-by-side view.")
flags.declare_key_flag("traceback")  # cli.run: user errors as one line unless --traceback
flags.declare_key_flag("allow_long_context")  # prompt + new tokens past the model's positions


def run_one(model, ids, method, sampling, max_new_tokens, prefill_chunk, mesh=None):
  """Warm-up (compiles the same shapes), then the timed generation (on ``mesh`` if given)."""
  from models import decode, sharding

  model, method = sharding.prepare(model, method, mesh)
  capacity = method.round_capacity(len(ids) + max_new_tokens)
  kw = dict(prefill_chunk=prefill_chunk, capacity=capacity, mesh=mesh)
  decode.generate(model, ids, 3, method, sampling, stop_at_eos=False, **kw)
  return decode.generate(model, ids, max_new_tokens, method, sampling, **kw)


def side_by_side(left_title, left, right_title, right, width) -> str:
  wrap = lambda s: sum((textwrap.wrap(p, width) or [""] for p in s.split("\n")), [])
  a, b = [left_title, "-" * width] + wrap(left), [right_title, "-" * width] + wrap(right)
  a += [""] * (len(b) - len(a))
  b += [""] * (len(a) - len(b))
  return "\n".join(f"{x:<{width}} | {y}" for x, y in zip(a, b))


def main(argv):
  del argv
  from experiments.common import checks  # pylint: disable=g-import-not-at-top

  # User errors fail here, before the model loads (cli.run prints them as one line).
  checks.check_budget(FLAGS.budget, "--budget")
  checks.check_model(FLAGS.model, tiny=False)
  mesh = distributed.mesh_from_flags()
  prompt = FLAGS.prompt
  if FLAGS.prompt_file:
    with open(FLAGS.prompt_file, encoding="utf-8") as f:
      prompt = f.read()
  from experiments.common import modelzoo  # pylint: disable=g-import-not-at-top
  from experiments.tasks import specs  # pylint: disable=g-import-not-at-top
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  specs.build(FLAGS.method, FLAGS.budget, block_size=FLAGS.block_size)
  model = models.load(FLAGS.model, dtype=FLAGS.dtype)
  ids = model.encode(prompt, chat=FLAGS.chat)
  checks.check_positions(len(ids), FLAGS.max_new_tokens, model.config.max_position_embeddings,
                         allow=cli.ALLOW_LONG_CONTEXT.value)
  sampling = models.Sampling(FLAGS.temperature, FLAGS.top_p, FLAGS.seed)
  dense = methods.make("dense", block_size=FLAGS.block_size)
  # specs.build: a budget means the kept fraction for every family (compression: ratio =
  # 1 - budget), and methods that model RoPE get the model's frequencies.
  method = specs.build(FLAGS.method, FLAGS.budget, block_size=FLAGS.block_size,
                       rope_inv_freq=modelzoo.rope_inv_freq(model))
  results = {}
  for label, m in (("dense", dense), (method.spec, method)):
    results[label] = run_one(model, ids, m, sampling, FLAGS.max_new_tokens, FLAGS.prefill_chunk,
                             mesh)
  print(f"model {FLAGS.model}, prompt {len(ids)} tokens, budget {FLAGS.budget}\n")
  (l_name, l_gen), (r_name, r_gen) = results.items()
  print(side_by_side(l_name, model.decode(l_gen.tokens[0]), r_name,
                     model.decode(r_gen.tokens[0]), FLAGS.width))
  print()
  print(f"{'method':<16}{'prefill tok/s':>15}{'decode tok/s':>15}{'new tokens':>12}")
  for name, g in results.items():
    print(f"{name:<16}{g.prefill_tokens_per_second:>15.1f}{g.decode_tokens_per_second:>15.2f}"
          f"{len(g.tokens[0]):>12}")


if __name__ == "__main__":
  cli.run(main)
