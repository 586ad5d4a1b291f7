r"""Per-layer decode latency on a GPU with the Pallas kernels (RESA Tables 3-4, Retro Table 6).

  python -m experiments.latency --config=configs/latency_gpu.py --workdir=results/latency_gpu

One Llama-3.1-8B attention layer (32 q / 8 kv heads, d = 128, batch 1, bfloat16 cache) at 8k /
32k / 128k, every method through the Pallas kernels (``impl=pallas``; dense through
``chunk_attention``, plus XLA's dense step as a second reference). Each timed call loops
``steps_per_call`` decode steps on the device, so the host's dispatch is not what is timed; the
records keep ``backend`` and ``device``, and the claims read GPU rows apart from the CPU ones.
RESA's decode overhead is measured both at ReSA's p = 0.1 and at RESA Table 4's fixed KV budget
of 500 tokens; ``resa`` times the last 1024-token prefill chunk with and without the prior (Table
3's chunk size).

Cost: ~5 min on one H100 (compilation dominates: 12 methods x 3 contexts).
"""

from configs import latency

GPU_METHODS = ",".join([
    "dense", "dense:impl=xla", "quest:gqa=head", "quest:gqa=group", "quest:gqa=group+resa",
    "quest:gqa=group,budget=500", "quest:gqa=group,budget=500+resa",
    "quest:gqa=group+retro:w=2", "quest:gqa=group+retro:w=4", "quest:gqa=group+retro:w=8",
    "quest:gqa=group+rect:f=32",
])


def get_config(quick: bool = False):
  c = latency.get_config(quick)
  if quick:
    return c
  c.sections = "per_layer,resa"
  c.dtypes = "bfloat16"
  c.contexts = "8192,32768,131072"
  c.methods = GPU_METHODS
  c.impl = "pallas"
  c.steps_per_call = 32
  c.warmup = 2
  c.repeats = 15
  c.resa_contexts = "8192,32768,131072"
  c.resa_chunk = 1024
  return c
