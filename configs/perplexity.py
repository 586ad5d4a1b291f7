r"""Perplexity under sparse decoding (experiments/perplexity.py): ReSA Sec. 3.2 and Retro Fig. 7.

  python -m experiments.perplexity --config=configs/perplexity.py --workdir=results/perplexity
  python -m experiments.perplexity --config=configs/perplexity.py --config.length=4096 \
      --config.xs=32,512,2048 --config.interval_length=8192 --config.interval=1024  # paper-like
  python -m experiments.perplexity --config=configs/perplexity.py --config.quick=True  # CI

Tail view: prefill ``length - x`` tokens, decode ``x`` (teacher forced), perplexity over the
last ``eval_tokens``; ``xs`` sweeps x for ``methods x budgets``, and at ``x = sweep_x`` the
rectification interval (``rect_fs``, ``sweep_selector+rect:f=F`` at ``sweep_budget``) and the
sparsity (``ps``: ``sweep_selector:p=P`` with and without ``+rect:f=sweep_f``). Interval view:
prefill ``interval_length / 2``, decode the rest, perplexity per ``interval`` tokens (0 = off).
Defaults are sized for a 2-core CPU.
"""

from ml_collections import config_dict


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.model = "smollm2-135m-instruct"
  c.text = "austen"
  c.methods = ("dense", "quest", "quest+rect:f=32", "quest+resa", "quest+retro")
  c.budgets = (0.05,)
  c.block_size = 16
  c.length = 2048
  c.num_docs = 2
  c.seed = 0
  c.xs = (32, 256)
  c.eval_tokens = 32
  c.sweep_x = 256
  c.sweep_selector = "quest"
  c.sweep_budget = 0.05
  c.sweep_f = 32
  c.rect_fs = (16, 64, 128)
  c.ps = (0.05, 0.2)
  c.interval_methods = ("dense", "quest", "quest+rect:f=32", "quest+retro")
  c.interval_length = 2048
  c.interval = 256
  if quick:
    c.model = "tiny-random"
    c.methods = ("dense", "quest+rect:f=4")
    c.budgets = (0.1,)
    c.length = 192
    c.num_docs = 1
    c.xs = (16,)
    c.eval_tokens = 8
    c.sweep_x = 16
    c.sweep_budget = 0.1
    c.sweep_f = 4
    c.rect_fs = ()
    c.ps = (0.2,)
    c.interval_methods = ("dense", "quest+retro")
    c.interval_length = 96
    c.interval = 16
  return c
