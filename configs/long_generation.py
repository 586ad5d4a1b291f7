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

Budgets follow RetroAttention (Table 1, Fig. 2b-c): Quest at a relative budget of 0.15 of the
growing context with a 256-token minimum and only the current page forced (at a 2k prompt:
~19 pages chosen by score, never zero), with ``+track`` / ``+reuse`` on it, and the ``retro``
preset at w = 2 / 4 / 8 (the effective-budget factor of Fig. 2c); ReSA's rectification and
RESA run at the same relative budget. Accuracy on a long-generation task is the
``configs/long_generation_qa.py`` config (``experiments.accuracy``).
"""

from ml_collections import config_dict

RETRO_QUEST = "quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside"


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.model = "smollm2-135m-instruct"
  c.text = "austen"
  c.methods = ("dense", RETRO_QUEST + "+track", RETRO_QUEST + "+reuse",
               RETRO_QUEST + "+rect:f=32", RETRO_QUEST + "+resa", "retro", "retro:w=4",
               "retro:w=8")
  c.budgets = ()
  c.block_size = 16
  c.prompt_length = 2048
  c.num_prompts = 1
  c.new_tokens = 256
  c.interval = 64
  c.seed = 0
  if quick:
    c.model = "tiny-random"
    c.methods = ("dense", "quest+track", "quest+reuse", "quest+retro:w=4")
    c.budgets = (0.1,)
    c.prompt_length = 160
    c.num_prompts = 2  # a batch of prompts: per-prompt factors
    c.new_tokens = 16
    c.interval = 8
  return c
