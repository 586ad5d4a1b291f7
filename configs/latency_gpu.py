r"""The GPU benchmark in one command: a named shape end to end, per layer, RESA's prefill overhead.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.latency \
      --config=configs/latency_gpu.py --workdir=results/latency_gpu

(``XLA_PYTHON_CLIENT_PREALLOCATE=false``: ``shape_e2e`` runs its models in child processes,
which need the GPU memory a preallocating parent would hold; the run refuses otherwise.)

``shape_e2e`` (issue 36): a random-weight model of Llama-3.1-8B's shape in bfloat16, batch 1
and 8 at 32k and 128k: greedy decode in ms per step and the prefill of the prompt, for dense,
Quest (group-shared, p = 0.1), +RESA and the paper presets ``rectified`` (ReSA) and
``resa-quest``, next to ``transformers``' ``LlamaForCausalLM`` (SDPA) on the same GPU; every
decode row with the bytes a step reads (weights + KV) and its fraction of the bandwidth bound
(``peak_bandwidth_gbs``, 0 = the data-sheet figure of the device's name: H100 SXM 3350, H200
4800 GB/s). Parts that do not fit (batch 8 at 128k: 128 GiB of KV) are recorded as skipped.

``per_layer`` + ``torch_peer``: one Llama-3.1-8B attention layer (32 q / 8 kv heads, d = 128,
batch 1, bfloat16 cache) at 8k / 32k / 128k, every method through the Pallas kernels
(``impl=pallas``; dense through ``chunk_attention``, plus XLA's dense step as a second
reference), next to ``torch.nn.functional.scaled_dot_product_attention`` on the same GPU and
``jax.nn.dot_product_attention`` (cuDNN's fused kernel where it takes the shape: the
alternative our dense decode could call, measured before it is chosen). Each
timed call loops ``steps_per_call`` decode steps on the device (torch: as many calls, one sync),
so the host's dispatch is not what is timed. RESA's decode overhead is measured both at ReSA's
p = 0.1 and at RESA Table 4's fixed KV budget of 500 tokens; ``resa`` times the last 1024-token
prefill chunk with and without the prior (Table 3's chunk size). ``prefill_chunk`` times one
layer's dense prefill chunk (``shape_prefill_chunk`` queries, the first and the last of each
context) through ``chunk_attention``'s Pallas kernel and through its in-order branch (cuDNN's
flash attention), the measurement behind that branch being the GPU default.

Cost on one H100 (estimates; each record keeps its first-call and model-building seconds):
``shape_e2e`` ~15-20 min (3 of the 4 (batch, context) cells fit: 5 methods x decode, whose fused
32-layer step compiles in ~0.5-1 min each, + 2 x 128k prefills + the peer), ``per_layer`` +
``resa`` ~5 min. In a 15-minute device lease run a subset, e.g. ``--config.sections=shape_e2e
--config.shape_batches=1`` (~8-10 min) and the per-layer sections in a second call.

CI: ``--config.quick=True`` runs the same sections on the CPU in well under a minute (the
``tiny`` shape at 128 tokens, batch 1 and 2, a nominal 50 GB/s peak: its numbers mean nothing).
"""

from configs import latency

GPU_METHODS = ",".join([
    "dense", "dense:impl=xla", "quest:gqa=head", "quest:gqa=group",
    # score_select's one launch beside the default two kernels (block_score + block_select)
    "quest:gqa=group,fused=true", "quest:gqa=group+resa",
    "quest:gqa=group,budget=500", "quest:gqa=group,budget=500+resa",
    # RESA's prior update and aggregator inputs in XLA ops (the path before issue 51 item 2)
    "quest:gqa=group+resa:fused=false", "quest:gqa=group,budget=500+resa:fused=false",
    "quest:gqa=group+retro:w=2", "quest:gqa=group+retro:w=4", "quest:gqa=group+retro:w=8",
    "quest:gqa=group+rect:f=32", "rectified",
])

_QUICK = dict(
    sections="shape_e2e,per_layer,torch_peer,prefill_chunk", methods="dense,quest:gqa=group",
    peak_bandwidth_gbs=50.0, shape="tiny", shape_dtype="float32", shape_batches="1,2",
    shape_contexts="128", shape_methods="dense,quest:gqa=group+resa,rectified,resa-quest",
    shape_prefill_methods="dense", shape_prefill_chunk=64, shape_decode_steps=4,
    shape_repeats=2, shape_part_timeout_s=120.0,
)


def get_config(quick: bool = False):
  c = latency.get_config(quick)
  if quick:
    c.update(_QUICK)
    return c
  c.sections = "shape_e2e,per_layer,torch_peer,resa"
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
