"""The GPU harness settings shared by configs/accuracy_gpu.py, perplexity_gpu.py and
long_generation_gpu.py (experiments.tasks.planned reads them)."""


def add(c, *, lockstep: bool = False, quick: bool = False):
  """Sets on config ``c`` the model (random Llama-3.1-8B weights, bfloat16), the memory plan and
  its overrides, the decode step and the prefill chunk; ``quick``: the CPU test's tiny model with
  the one-program step forced. ``lockstep``: the cap on methods decoded beside dense."""
  c.model = "random:llama-3.1-8b"
  c.dtype = "bfloat16"
  c.batch_plan = True
  c.batch_size = 0  # 0: the memory plan's; N: N rows whatever the plan says
  c.prefill_batch = 0  # compression methods' prefill sub-batch (0: the plan's)
  c.memory_margin = 0.1  # of the device's memory, kept free on top of 1 GiB
  if lockstep:
    c.lockstep_methods = 0  # methods beside dense in one lockstep group (0: as many as fit)
  c.decode_step = "auto"  # auto (one program on a GPU) | program | per_layer
  c.prefill_chunk = 2048
  if "bucket_capacity" in c:
    c.bucket_capacity = False  # the memory plan sizes exact caches; one shape per batch anyway
  if quick:
    c.model = "tiny-random"
    c.dtype = "float32"
    c.decode_step = "program"  # the GPU's one-program step, forced on the CPU
  return c
