r"""Long-generation fidelity (experiments/long_generation.py): divergence, edit similarity, KL.

  python -m experiments.long_generation --config=configs/long_generation.py \
      --workdir=results/long_generation
  python -m experiments.long_generation --config=configs/long_generation.py \
      --config.new_tokens=2048 --config.interval=256  # paper-like lengths (GPU)
  python -m experiments.long_generation --config=configs/long_generation.py --config.quick=True

Prompts are ``num_prompts`` windows of ``prompt_length`` tokens of ``text``; every method
generates ``new_tokens`` greedily (no EOS stop). ``+track`` measures adjacent-query block overlap
(its outputs equal the plain selector's), ``+reuse`` is the top-k-reuse baseline (Retro Table 4),
``+retro:w=W`` reports its effective budget factor. Defaults are sized for a 2-core CPU.
"""

from ml_collections import config_dict


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.model = "smollm2-135m-instruct"
  c.text = "austen"
  c.methods = ("dense", "quest+track", "quest+reuse", "quest+rect:f=32", "quest+resa",
               "quest+retro:w=2", "quest+retro:w=4", "quest+retro:w=8")
  c.budgets = (0.05,)
  c.block_size = 16
  c.prompt_length = 1024
  c.num_prompts = 1
  c.new_tokens = 256
  c.interval = 64
  c.seed = 0
  if quick:
    c.model = "tiny-random"
    c.methods = ("dense", "quest+track", "quest+reuse", "quest+retro:w=4")
    c.budgets = (0.1,)
    c.prompt_length = 160
    c.new_tokens = 16
    c.interval = 8
  return c
