r"""RULER-style accuracy (experiments/accuracy.py): methods x budgets x tasks x lengths.

  python -m experiments.accuracy --config=configs/accuracy.py --workdir=results/accuracy
  python -m experiments.accuracy --config=configs/accuracy.py \
      --config.model=qwen2.5-coder-0.5b-instruct --config.lengths=4096 --workdir=results/acc_qwen
  python -m experiments.accuracy --config=configs/accuracy.py --config.quick=True  # CI smoke

Defaults are sized for a 2-core CPU (a few samples per cell at 1k-4k, minutes per cell); raise
``num_samples`` and ``lengths`` on a GPU. Budgets are fractions of the context kept
(compression methods: ``ratio = 1 - budget``).
"""

from ml_collections import config_dict


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.model = "smollm2-135m-instruct"
  c.methods = ("dense", "quest", "quest+resa", "quest+retro", "quest+rect")
  c.budgets = (0.05,)
  c.block_size = 16
  c.tasks = ("passkey", "niah_single_1", "niah_single_2", "niah_multikey_1")
  c.lengths = (1024, 2048, 4096)
  c.num_samples = 3
  c.depths = ()  # empty: an even sweep of [0, 1] over the samples
  c.seed = 0
  c.haystack = "essays"  # essay haystack text: essays (Paul Graham) | austen | a novel
  c.chat = True
  c.batch_size = 4
  c.max_new_tokens = 0  # 0: the task's own (ruler.MAX_NEW_TOKENS)
  if quick:
    c.model = "tiny-random"
    c.methods = ("dense", "quest+rect:f=4", "quest+retro")
    c.tasks = ("passkey", "qa")
    c.lengths = (192,)
    c.num_samples = 1
    c.max_new_tokens = 6
  return c
