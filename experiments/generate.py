r"""The main job: a sparse method next to dense attention on a long prompt, with what it reads.

  python -m experiments.generate --method=quest --budget=0.1
  python -m experiments.generate --prompt="Explain sparse attention." --method=quest --budget=0.1

By default the prompt is chapter 1 of *Pride and Prejudice* (bundled, ~1,270 tokens) with a
password planted near its start, and a question asking for it (``experiments.common.passage``):
dense answers it, so whether a sparse method still does is the comparison. Prints both answers
side by side, then per method the share of the prompt it attends per head (forced sinks and
local window + blocks chosen by score; ``experiments.common.sparsity``), prefill and decode
tokens/s, whether it answered right (default prompt), a warning when a method attends the whole
prompt (a prompt shorter than its forced entries, or a budget covering it, makes it dense), and
a note when a sparse method is slower than dense (``experiments.common.main_report``: at this
length the cache is a small share of what a decode step reads). Progress lines (loading,
compiling, prefill chunk i of N, decoding) go to stderr. A prompt plus new tokens beyond the
model's ``max_position_embeddings`` is refused unless ``--allow_long_context``.

A method that observes the question (FINCH, query-aware) is told which prompt tokens are the
question: the default prompt's, or ``--question`` (appended to ``--prompt`` / ``--prompt_file``
after a blank line). A custom prompt without ``--question`` has no known question: FINCH then
observes its last ``window_size`` tokens (its fallback). Methods calibrated on the model
(Q-Filters' filters, DuoAttention's head scores: ``experiments.common.calibration``) compute
their table once per model (cached under ``$SPARSE_ATTN_CACHE``); ``calibration=prompt`` in the
spec keeps their prompt fallback instead.

``--mesh=data:2,model:2,seq:2`` runs both on a device mesh (``--distributed`` first calls
``jax.distributed.initialize()``, see ``experiments/common/distributed.py``).

Flags pick the model (default: the embedded SmolLM2-135M-Instruct), the method spec (any string
``sparse_attn.methods.make`` accepts) and its budget. Timings exclude compilation: each run is
preceded by a warm-up with the same shapes.
"""

from __future__ import annotations

from absl import flags

from experiments.common import cli, distributed

FLAGS = flags.FLAGS
distributed.define_flags()  # --mesh=data:2,model:2,seq:2, --distributed
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model name or HF directory.")
flags.DEFINE_string("prompt", None, "Prompt text (default: a bundled Austen chapter with a "
                    "planted password and a question asking for it, ~1,270 tokens).")
flags.DEFINE_string("prompt_file", None, "Read the prompt from this file instead.")
flags.DEFINE_string("question", None, "Question appended to --prompt / --prompt_file (after a "
                    "blank line); its tokens are the question a query-aware method (FINCH) "
                    "observes. Without it a custom prompt's question is unknown and FINCH "
                    "observes the prompt's last window_size tokens.")
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


def run_one(model, ids, method, sampling, max_new_tokens, prefill_chunk, mesh=None,
            stages=None, label="", question_length=None):
  """Warm-up (compiles the same shapes), then the timed generation (on ``mesh`` if given).

  ``stages``: an ``experiments.common.stages.Stages`` for progress lines, or None.
  ``question_length``: the prompt's last tokens that are its question (None: not known).
  """
  from models import decode, sharding

  model, method = sharding.prepare(model, method, mesh)
  capacity = method.round_capacity(len(ids) + max_new_tokens)
  kw = dict(prefill_chunk=prefill_chunk, capacity=capacity, mesh=mesh,
            question_length=question_length)
  if stages:
    stages.start(f"{label}: compiling (an untimed warm-up on the same shapes)")
  decode.generate(model, ids, 3, method, sampling, stop_at_eos=False,
                  progress=stages.callback(f"{label} warm-up") if stages else None, **kw)
  if stages:
    stages.start(f"{label}: timed run")
  return decode.generate(model, ids, max_new_tokens, method, sampling,
                         progress=stages.callback(label) if stages else None, **kw)


def prompt_ids(model, context: str, question: str | None, chat: bool):
  """``(ids, question tokens or None)`` of ``context`` + a blank line + ``question``: the
  question's tokens are the ids past the longest prefix shared with the context's own ids
  (with ``chat``, the template's end and the assistant's start count with the question, as in
  the accuracy harness's ``context_split``)."""
  if question is None:
    return model.encode(context, chat=chat), None
  ids = model.encode(f"{context}\n\n{question}", chat=chat)
  head = model.encode(context, chat=chat)
  n = next((i for i, (a, b) in enumerate(zip(ids, head)) if a != b), min(len(ids), len(head)))
  return ids, len(ids) - n


def main(argv):
  del argv
  from experiments.common import checks  # pylint: disable=g-import-not-at-top

  # User errors fail here, before the model loads (cli.run prints them as one line).
  checks.check_budget(FLAGS.budget, "--budget")
  checks.check_model(FLAGS.model, tiny=False)
  if FLAGS.question is not None and FLAGS.prompt is None and not FLAGS.prompt_file:
    raise ValueError("--question goes with --prompt or --prompt_file (the default prompt has "
                     "its own question)")
  mesh = distributed.mesh_from_flags()
  # pylint: disable=g-import-not-at-top
  from experiments.common import main_report, passage, sparsity, specs
  from experiments.common import stages as stages_lib
  from sparse_attn import layer_inputs, methods
  import models
  # pylint: enable=g-import-not-at-top
  source, prompt, question = "--prompt", FLAGS.prompt, FLAGS.question
  if FLAGS.prompt_file:
    with open(FLAGS.prompt_file, encoding="utf-8") as f:
      source, prompt = FLAGS.prompt_file, f.read()
  elif prompt is None:
    source, prompt, question = f"{passage.SOURCE} + a question", passage.with_fact(), (
        passage.QUESTION)
  default = FLAGS.prompt is None and not FLAGS.prompt_file
  # Built before the model loads, so a bad spec fails at once. specs.build: a budget means the
  # kept fraction for every family (methods.make turns it into a compression ratio).
  method = specs.build(FLAGS.method, FLAGS.budget, block_size=FLAGS.block_size)
  stages = stages_lib.Stages("generate")
  stages.start(f"loading {FLAGS.model}")
  model = models.load(FLAGS.model, dtype=FLAGS.dtype)
  ids, asked = prompt_ids(model, prompt, question, FLAGS.chat)
  checks.check_positions(len(ids), FLAGS.max_new_tokens, model.config.max_position_embeddings,
                         allow=cli.ALLOW_LONG_CONTEXT.value)
  sampling = models.Sampling(FLAGS.temperature, FLAGS.top_p, FLAGS.seed)
  dense = methods.make("dense", block_size=FLAGS.block_size)
  method = specs.for_model(method, model)  # RoPE frequencies, calibration tables
  method = layer_inputs.sized_for(method, asked)  # FINCH's ring holds the whole question
  label = FLAGS.method if FLAGS.budget is None else f"{FLAGS.method}@{FLAGS.budget:g}"
  results = {}
  for name, m in (("dense", dense), (label, method)):
    results[name] = run_one(model, ids, m, sampling, FLAGS.max_new_tokens, FLAGS.prefill_chunk,
                            mesh, stages, name, asked)
  print(f"model {FLAGS.model}, prompt {len(ids)} tokens ({source})")
  if default:
    print(f"question: {passage.QUESTION} (planted: {passage.FACT})")
  print()
  texts = {name: model.decode(g.tokens[0]) for name, g in results.items()}
  (l_name, l_text), (r_name, r_text) = texts.items()
  print(main_report.side_by_side(l_name, l_text, r_name, r_text, FLAGS.width))
  print()
  right = {n: passage.is_right(t) for n, t in texts.items()} if default else None
  print(main_report.report(results, {"dense": dense, label: method}, len(ids), right=right,
                           cache_share=sparsity.cache_share(model, len(ids)),
                           num_layers=model.config.num_layers))
  print(f"\n{main_report.verdict(label, texts, right)}")


if __name__ == "__main__":
  cli.run(main)
