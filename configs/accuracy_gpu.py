r"""The RULER grid on one GPU at 32k / 64k / 128k, batched by a memory plan, for any checkpoint.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.accuracy \
      --config=configs/accuracy_gpu.py --config.model=/path/to/Llama-3.1-8B-Instruct \
      --workdir=results_gpu/accuracy
  # one length, two methods, a batch of your choosing:
  ... "--config.lengths=(32768,)" "--config.methods=('dense','expected-attention@0.5')" \
      --config.batch_size=4
  python -m experiments.accuracy --config=configs/accuracy_gpu.py --config.quick=True  # CPU

``model``: any Hugging Face directory ``models.load`` takes (``llama``, ``qwen2``, ``qwen3``,
``mistral``, ``phi3``), loaded in ``dtype`` (bfloat16); the default ``random:llama-3.1-8b`` is
Llama-3.1-8B's shape with random weights and SmolLM2's tokenizer (``random:SHAPE:DIR`` reads a
saved tokenizer from DIR): what it costs is real, its accuracies are meaningless.
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` lets the plan read the device's free memory as it is
(JAX otherwise takes 75% of it at start; the plan still fits inside that).

What runs (``experiments.tasks.accuracy``, ``batch_plan=True``): RESA's RULER task mix, query
-aware (the whole prompt prefilled, then the answer decoded greedily), every method on its own
(no prefill shared between methods) with the batch ``experiments.tasks.batch_plan`` chooses from
the device's memory: the method's cache and state per sample at the length (exact, from its own
layouts; a compression method's compacted cache), the weights, a prefill chunk's activations and
a margin of ``memory_margin`` of the device plus 1 GiB; ``batch_size`` > 0 overrides it,
``prefill_batch`` the compression methods' prefill sub-batch. Samples of one length are batched
across tasks (each answer cut at its own task's cap), prompts right-padded (ragged), prefilled in
chunks of ``prefill_chunk`` tokens, compression scoring at the end of the prompt; each decode step
is one device program (``decode_step=auto`` on a GPU). A batch that runs out of memory is retried
at half the size. Records add the plan (``plan_batch``, ``plan_bytes``, ...) and the device's
peak bytes (``peak_bytes``). ``sample_cache`` (a directory) keeps the generated prompts, so a
second process (another method) does not generate them again.

Lengths: 32768, 65536 and 130944 prompt tokens: at 128k the prompt plus a 128-token answer fills
Llama-3.1's 131,072 positions (RULER counts the answer in its length).

Cost: not measured yet (no GPU run of this config so far). ``python -m
experiments.ruler_throughput`` measures samples per hour of its 32k cell on a GPU next to kvpress
(``experiments/ruler_gpu.sh``).
"""

from configs import _gpu_settings as gpu_settings
from configs import accuracy


def get_config(quick: bool = False):
  c = accuracy.get_config(quick)
  gpu_settings.add(c, quick=quick)
  c.methods = ("dense", "quest", "resa-quest", "expected-attention@0.5", "snapkv@0.5")
  c.budgets = (0.025,)
  c.pairs = (("resa-quest", "quest"),)
  c.lengths = (32768, 65536, 130944)
  c.num_samples = 5
  c.batch_across_tasks = True
  c.sample_cache = ""  # a directory: generated prompts kept there, keyed by what made them
  if quick:
    c.methods = ("dense", "quest", "resa-quest", "snapkv@0.5")
    c.budgets = (0.1,)
    c.pairs = (("resa-quest", "quest"),)
    c.tasks = ("niah_single_1", "qa")
    c.lengths = (320,)
    c.num_samples = 2
    c.prefill_chunk = 128
    c.max_new_tokens = 6
  return c
