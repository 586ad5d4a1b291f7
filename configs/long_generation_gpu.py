r"""Long-generation fidelity on one GPU at 32k / 64k / 128k prompts, batched by a memory plan.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.long_generation \
      --config=configs/long_generation_gpu.py --config.model=/path/to/Llama-3.1-8B-Instruct \
      --workdir=results_gpu/long_generation
  # one length, two methods, a batch of your choosing:
  ... "--config.prompt_lengths=(32768,)" "--config.methods=('dense','retro')" \
      --config.batch_size=2
  python -m experiments.long_generation --config=configs/long_generation_gpu.py \
      --config.quick=True  # CPU

``model``: any Hugging Face directory ``models.load`` takes, loaded in ``dtype`` (bfloat16); the
default ``random:llama-3.1-8b`` is Llama-3.1-8B's shape with random weights and SmolLM2's
tokenizer: what it costs is real, its divergences are meaningless.

What runs (``experiments.tasks.long_generation``, ``batch_plan=True``): ``configs/
long_generation.py``'s rows (RetroAttention's Quest at 0.15 with +track / +reuse / +rect /
+resa, the retro preset at w = 2 / 4 / 8) generate ``new_tokens`` = 1024 greedily after prompts
of each of ``prompt_lengths`` tokens (32768, 65536 and 130048: the prompt and the answer fill
Llama-3.1's 131,072 positions). Each method generates on its own with the prompt batch its
memory plan chose (``experiments.tasks.batch_plan``; ``batch_size`` > 0 overrides it), then
the methods are teacher-forced along dense's output in lockstep groups beside dense (as many
as fit one prompt beside it, ``lockstep_methods`` caps a group), each with its planned batch;
every method prefilled on its own in chunks of ``prefill_chunk`` (compression in sub-batches),
each decode step one device program (``decode_step=auto`` on a GPU), an out-of-memory batch
retried at half the size. Records keep ``configs/long_generation.py``'s fields and add the
generation plan, the lockstep batch and the device's peak bytes. Tokens and numbers equal the
CPU loop's (``tests/experiments/test_lockstep_gpu.py``).

Cost: not measured yet (no GPU run of this config so far).
"""

from configs import _gpu_settings as gpu_settings
from configs import long_generation


def get_config(quick: bool = False):
  c = long_generation.get_config(quick)
  gpu_settings.add(c, lockstep=True, quick=quick)
  c.prompt_lengths = (32768, 65536, 130048)  # ``prompt_length`` is not read
  c.num_prompts = 4
  c.new_tokens = 1024
  c.interval = 128
  if quick:
    c.methods = ("dense", "quest+retro:w=4", "snapkv@0.5")
    c.prompt_lengths = (160,)
    c.num_prompts = 3
    c.new_tokens = 8
    c.interval = 4
    c.lockstep_methods = 2
    c.prefill_chunk = 64
  return c
