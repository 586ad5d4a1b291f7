r"""Decode latency and memory benchmark (issue 9).

  python -m experiments.latency --config=configs/latency.py --workdir=results/latency

Subsets: ``--config.sections=per_layer,torch_peer`` (of ``per_layer, torch_peer, end_to_end,
memory, resa, prefill``), ``--config.contexts=8192,32768``, ``--config.dtypes=bfloat16``,
``--config.methods=dense,quest:gqa=group``. CI: ``--config.quick=True`` (tiny shapes, the
``tiny-random`` model, and the Pallas kernels in interpret mode on one tiny shape).
GPU: ``--config.impl=pallas`` (``pip install -e ".[gpu]"``) adds achieved bandwidth vs peak;
``configs/latency_gpu.py`` is the GPU run, with the ``shape_e2e`` section (a named Hugging Face
shape end to end, fields ``shape_*`` below).
"""

import ml_collections

# Methods of the per-layer section (spec strings; p, block_size, impl are added from the config).
# Enhancers ride on ReSA's group-shared Quest selection, the fast one; "quest:gqa=head" is
# Quest's per-query-head selection (G x more KV read).
PER_LAYER_METHODS = ",".join([
    "dense", "quest:gqa=head", "quest:gqa=group", "quest:gqa=group+resa",
    "quest:gqa=group+retro:w=2", "quest:gqa=group+retro:w=4", "quest:gqa=group+retro:w=8",
    "quest:gqa=group+rect:f=32", "topk:gqa=group",
])

# --config.quick=True: every code path on tiny shapes (numbers mean nothing).
_QUICK = dict(
    num_heads=4, num_kv_heads=2, head_dim=16, contexts="256", dtypes="float32", repeats=2,
    warmup=0,
    # every enhancer in one spec (one compilation), and the Pallas kernel in interpret mode
    methods=("dense,quest:gqa=group+resa+rect:f=8+retro:w=2,topk:gqa=group,"
             "quest:gqa=group,impl=pallas,interpret=true"),
    model="tiny-random", e2e_methods="dense,quest:gqa=group", prefill_contexts="64",
    decode_contexts="64", decode_steps=2, prefill_chunk=32, memory_context=512,
    memory_layers=2, memory_methods="dense,expected_attention:ratio=0.5", resa_contexts="256",
    resa_chunk=32, max_seconds_per_context=10.0,
    prefill_models="tiny-random", prefill_lengths="64,128", prefill_repeats=2,
)


def get_config(quick: bool = False):
  c = ml_collections.ConfigDict()
  c.quick = quick  # tiny shapes + tiny-random model (CI): _QUICK below
  c.sections = "per_layer,torch_peer,end_to_end,memory,resa,prefill"
  c.seed = 0
  c.threads = 0  # torch threads; 0 = os.cpu_count() (XLA:CPU uses every core)
  c.warmup = 1  # untimed calls after compilation
  c.repeats = 7  # timed rounds (methods interleaved round-robin); medians are reported
  # ---- per layer (Llama-3.1-8B attention) ----
  c.num_heads = 32
  c.num_kv_heads = 8
  c.head_dim = 128
  c.contexts = "8192,32768,131072"
  c.dtypes = "float32,bfloat16"
  c.methods = PER_LAYER_METHODS
  c.block_size = 16
  c.p = 0.1  # ReSA's sparsity ratio: n = max(n_min, ceil(M p)) blocks
  c.impl = "auto"  # auto | xla | pallas
  c.interpret = False  # Pallas interpret mode (CPU)
  c.peak_bandwidth_gbs = 0.0  # device peak for the achieved-bandwidth column (0 = auto on GPU)
  c.max_seconds_per_context = 240.0  # fewer rounds at long contexts when a step is slow
  # Decode steps per timed call, looped on the device (times are per step). 1 on a CPU, where a
  # step takes milliseconds; configs/latency_gpu.py loops so that dispatch is not what is timed.
  c.steps_per_call = 1
  # ---- end to end ----
  c.model = "smollm2-135m-instruct"
  c.e2e_methods = "dense,quest:gqa=group,quest:gqa=group+resa"
  c.e2e_budget_p = 0.1
  c.prefill_contexts = "2048,8192"
  c.decode_contexts = "2048,8192,32768"
  c.decode_steps = 16
  c.prefill_chunk = 512
  c.transformers = True  # the PyTorch peer (transformers generate, CPU)
  # ---- memory ----
  c.memory_context = 32768
  # Layers of the Llama-8B-shaped stack held in memory (32 = the whole model). Compression
  # prefills each layer densely and then evicts, so one layer's dense cache is a transient on
  # top of the kept ones: with few layers it dominates the peak.
  c.memory_layers = 32
  c.memory_dtype = "bfloat16"
  c.memory_methods = "dense,expected_attention:ratio=0.5,expected_attention:ratio=0.9"
  # ---- RESA overheads ----
  c.resa_contexts = "8192,32768"
  c.resa_chunk = 512
  # ---- dense prefill vs transformers (same weights, same threads) ----
  c.prefill_models = "smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct"
  c.prefill_lengths = "2048,8192"
  c.prefill_layers = 0  # 0 = every layer; n = the first n layers of both models (faster)
  c.prefill_repeats = 3  # interleaved rounds; medians and their ratio are reported
  # ---- shape_e2e: a named HF shape, random weights, vs transformers (a GPU section) ----
  c.shape = "llama-3.1-8b"  # experiments/latency_lib/shapes.py: SHAPES
  c.shape_dtype = "bfloat16"
  c.shape_batches = "1,8"
  c.shape_contexts = "32768,131072"
  # Selectors get p = e2e_budget_p and block_size; presets run as the paper set them.
  c.shape_methods = "dense,quest:gqa=group,quest:gqa=group+resa,rectified,resa-quest"
  c.shape_prefill_methods = "dense,quest:gqa=group+resa"  # prefill is dense attention + digests
  c.shape_prefill_batches = "1"
  c.shape_prefill_chunk = 4096
  c.shape_decode_steps = 64  # per timed round (rounded up to whole rectification periods)
  c.shape_repeats = 3  # timed rounds; the median is reported
  c.shape_transformers = True  # the transformers LlamaForCausalLM (SDPA) peer rows
  c.shape_part_timeout_s = 420.0  # per part (model building counts against the first)
  if quick:
    c.update(_QUICK)
  return c
