r"""Perplexity under sparse decoding at 8k on SmolLM2: ReSA Fig. 4-5, RetroAttention Fig. 7.

  python -m experiments.perplexity --config=configs/perplexity.py --workdir=results/perplexity
  # parts: the tail view alone, or the interval view alone
  python -m experiments.perplexity --config=configs/perplexity.py --config.interval_length=0
  python -m experiments.perplexity --config=configs/perplexity.py --config.xs=
  python -m experiments.perplexity --config=configs/perplexity.py --config.quick=True  # CI

Tail view (ReSA Sec. 3.2): windows of ``length`` = 8192 tokens of Austen (SmolLM2's whole
trained context); the first ``L - x`` are prefilled densely, the last ``x`` decoded through
the method (teacher forced), perplexity over the final 32 tokens. Fig. 4: ReSA's selection
(Quest, group-shared, n = max(n_min, ceil(M p)) blocks counting the local block, no sink,
p = 0.1) without rectification at x = 32 / 256 / 1024 (x is the distance from the last dense
encoding, i.e. the rectification interval), and the ``rectified`` preset (f = 32) at the same
x; f sweep 16 / 32 / 64 / 128 at x = 1024; Fig. 5: p in 0.2 / 0.1 / 0.05 / 0.02 (sparsity 0.8
/ 0.9 / 0.95 / 0.98) with and without rectification at f = 32, at x = 1024.

Interval view (Retro Fig. 7): prefill ``interval_length / 2`` = 4096, then 4096 tokens decoded
through Quest at RetroAttention's relative budget (b = 0.15, 256-token minimum) without and
with the retrospective window (w = 2), perplexity per 512-token interval. The paper prefills
8k and decodes 8k on Llama-3.1 (128k context); SmolLM2's 8k trained context halves both.

Samples: ``num_docs`` = 4 documents x 32 scored tokens per tail cell (128 tokens), 2 documents
x 4096 decoded tokens in the interval view; documents run one at a time (``doc_batch``).

Cost (2 cores, idle-machine estimate; SmolLM2 is ~4x cheaper per token than Qwen): an 8k
prefill ~25 s; lockstep decoding ~0.05 s per step and row. Tail: 3 x per document, with 3 / 3 /
13 rows over 32 / 256 / 1024 steps: ~12 min per document, ~50 min for 4. Interval: 3 rows x
4095 steps per document, ~10 min each, ~20 min. Memory: every row's 8k cache (~380 MB) is alive
in the lockstep (13 rows at x = 1024: ~5 GB).
"""

from ml_collections import config_dict

RESA_SELECTION = "quest:gqa=group,n_min=16,n_local=1,n_sink=0,forced_count=inside"
RETRO_QUEST = "quest:budget=0.15,min_tokens=256,n_sink=0,local_window=1,forced_count=inside"


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.model = "smollm2-135m-instruct"
  c.text = "austen"
  c.methods = ("dense", RESA_SELECTION + ",p=0.1", "rectified")
  c.budgets = ()
  c.block_size = 16
  c.length = 8192
  c.num_docs = 4
  c.doc_batch = 1
  c.seed = 0
  c.xs = (32, 256, 1024)
  c.eval_tokens = 32
  c.sweep_x = 1024
  c.sweep_selector = RESA_SELECTION
  c.sweep_p = 0.1
  c.sweep_f = 32
  c.rect_fs = (16, 32, 64, 128)
  c.ps = (0.2, 0.1, 0.05, 0.02)
  c.interval_methods = ("dense", RETRO_QUEST, "retro")
  c.interval_length = 8192
  c.interval = 512
  c.interval_docs = 2
  if quick:
    c.model = "tiny-random"
    c.methods = ("dense", "quest+rect:f=4")
    c.budgets = (0.1,)
    c.length = 192
    c.num_docs = 2
    c.xs = (16,)
    c.eval_tokens = 8
    c.sweep_x = 16
    c.sweep_selector = "quest"
    c.sweep_p = 0.2
    c.sweep_f = 4
    c.rect_fs = (4,)
    c.ps = (0.2,)
    c.interval_methods = ("dense", "quest+retro")
    c.interval_length = 96
    c.interval = 16
    c.interval_docs = 1
  return c
