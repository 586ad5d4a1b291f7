r"""Perplexity under sparse decoding on one GPU at 32k / 64k / 128k, batched by a memory plan.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.perplexity \
      --config=configs/perplexity_gpu.py --config.model=/path/to/Llama-3.1-8B-Instruct \
      --workdir=results_gpu/perplexity
  # one length, the tail view only, a batch of your choosing:
  ... "--config.lengths=(65536,)" --config.interval_length=0 --config.batch_size=2
  python -m experiments.perplexity --config=configs/perplexity_gpu.py --config.quick=True  # CPU

``model``: any Hugging Face directory ``models.load`` takes, loaded in ``dtype`` (bfloat16); the
default ``random:llama-3.1-8b`` is Llama-3.1-8B's shape with random weights and SmolLM2's
tokenizer: what it costs is real, its perplexities are meaningless.

What runs (``experiments.tasks.perplexity``, ``batch_plan=True``): ``configs/perplexity.py``'s
two views on windows of Austen, the tail view (ReSA Fig. 4-5: ``L - x`` prefilled, ``x``
teacher-forced, the last 32 scored; its f and p sweeps at ``x = 1024``) at each of ``lengths``
(32768, 65536, 131072 tokens: Llama-3.1's whole 131,072 positions), and the interval view
(Retro Fig. 7: 8k prefilled, 8k decoded, as the paper). Per job the methods run in lockstep
groups beside dense (the KL reference), as many in a group as fit one document beside it, each
group with the document batch its memory plan chose (``experiments.tasks.batch_plan``: the
group's caches and states per document, the weights, a prefill chunk's activations, a margin of
``memory_margin`` of the device plus 1 GiB; ``batch_size`` > 0 overrides it,
``lockstep_methods`` caps a group); each method prefilled on its own in chunks of
``prefill_chunk`` (compression in sub-batches of ``prefill_batch``), each decode step one device
program (``decode_step=auto`` on a GPU). One record per (method, document) with the plan, the
lockstep group and the device's peak bytes; a batch that runs out of memory is retried at half
the size. Each record's numbers equal the CPU loop's (``tests/experiments/test_lockstep_gpu.py``).

Cost: not measured yet (no GPU run of this config so far).
"""

from configs import _gpu_settings as gpu_settings
from configs import perplexity


def get_config(quick: bool = False):
  c = perplexity.get_config(quick)
  gpu_settings.add(c, lockstep=True, quick=quick)
  c.methods = c.methods + ("snapkv@0.5",)
  c.lengths = (32768, 65536, 131072)  # the tail view's; ``length`` is not read
  c.interval_length = 16384
  if quick:
    c.methods = ("dense", "quest+rect:f=4", "snapkv@0.5")
    c.lengths = (192,)
    c.rect_fs = ()
    c.ps = (0.2,)
    c.interval_methods = ("dense", "quest+retro")
    c.interval_length = 96
    c.lockstep_methods = 2
    c.prefill_chunk = 64
  return c
