r"""Expected Attention against six eviction baselines, query-agnostic, on Qwen (EA Table 1).

  python -m experiments.accuracy --config=configs/accuracy_compression.py \
      --workdir=results/accuracy_compression
  # the most important cells first (EA vs the baselines at ratio 0.5):
  python -m experiments.accuracy --config=configs/accuracy_compression.py \
      --workdir=results/accuracy_compression "--config.budgets=(0.5,)"
  python -m experiments.accuracy --config=configs/accuracy_compression.py --config.quick=True

Protocol (Expected Attention Sec. 4, kvpress): the context is prefilled and compressed before
the question is appended (``protocol=query_agnostic``; the question and the chat template's end
are then read through the compressed cache in one chunk, ``method.extend``, which equals reading
them one decode step at a time), greedy answers, RULER string match. Budgets are
the kept fractions 0.75 / 0.5 / 0.25 / 0.1, i.e. compression ratios 0.25 / 0.5 / 0.75 / 0.9.
``expected-attention`` is the paper's preset (Ada-KV head budgets, 512 future positions,
eps = 0.01, covariance and value norm); the baselines run with their own defaults. One prefill
per batch serves every method and ratio (``experiments.tasks.compression_union``); dense reads
the same cache. "EA vs each baseline" is paired on the same samples (paired bootstrap, McNemar).

Samples: 5 per (task, length) over the 12 tasks: 60 per method x ratio (the headline cell).

Cost (2 cores): one shared prefill per 5-prompt batch, then per row the question in one chunk
(11x faster than one decode step per token: ``python -m experiments.compaction_bench
--spec=expected_attention --context=1024 --question_tokens=60``) and the answer one step at a
time. H2O's accumulated attention was most of the shared prefill until it visited only the key
tiles a query block can see (``observe.column_sums``, 2026-11-27): one 8k batch of all 29 rows
then took ~8 min on both cores in one process (~4 min for the prefill and dense's row, ~6 s a
compressed row), the 8k grid ~1.6 h; before, ~20.5 min a batch (~14 min of prefill). Two
processes side by side are slower than one with both cores. Run it in slices (methods, budgets,
tasks and lengths are keyed, so slices resume and extend one another), ratio 0.5 first, and
join slices run in other workdirs with ``python -m experiments.merge``.
"""

from configs import accuracy

BASELINES = ("snapkv", "tova", "h2o", "keydiff", "knorm", "streaming_llm")


def get_config(quick: bool = False):
  c = accuracy.get_config(quick)
  c.protocol = "query_agnostic"
  c.methods = ("dense", "expected-attention") + BASELINES
  c.budgets = (0.75, 0.5, 0.25, 0.1)
  c.pairs = tuple(("expected-attention", b) for b in BASELINES)
  c.lengths = (4096, 8192)
  if quick:
    c.methods = ("dense", "expected-attention", "snapkv", "h2o", "tova")
    c.budgets = (0.5,)
    c.pairs = (("expected-attention", "snapkv"),)
    c.lengths = (256,)
  return c

