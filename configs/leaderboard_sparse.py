r"""The sparse-decode methods of 2025 on the RULER leaderboard beside Quest, on Qwen.

  python -m experiments.accuracy --config=configs/leaderboard_sparse.py \
      --workdir=results/leaderboard_sparse "--config.lengths=(4096,)"

Rows: TidalDecode, ShadowKV's selection, Twilight (Quest's candidates pruned to top-p mass
with low-bit keys), RocketKV (SnapKV++ eviction, then its hybrid top-k) and its stage-2
selector ``hybrid`` alone, each at 2.5 / 5 / 10% of the context (ShadowKV twice: with the
authors' 48 outlier blocks, which at 4K are 19% of the context on top of the budget, and with
the paper's 0.3% of the blocks, ``outlier_share=0.003``: 1 block at 4K), with Quest at the same
fractions as every row's pair (run here again beside every row; pairs are by sample, and its
cells equal ``results/ruler_accuracy``'s on the same samples, dense's too: every prediction,
at 4k and 8k, across runs and revisions, a test over the committed records). Protocol, task
mix, samples and generator as ``configs/accuracy.py`` (RESA's: the question prefilled with
the context, 12 RULER tasks x 5 samples at 4k and 8k, greedy answers, string match). Those are
also the query-aware compression panel's (``configs/leaderboard_compression_qa.py``), so both
can run in one process, one dense prefill per batch serving every row (at 8k they did: add its
rows as ``"snapkv@0.75"``, ... to ``--config.methods`` and split the records by method).
"""

from configs import accuracy

NEW_SPARSE_DECODE = ("tidaldecode", "shadowkv", "shadowkv:outlier_share=0.003", "twilight",
                     "rocketkv", "hybrid")


def get_config(quick: bool = False):
  c = accuracy.get_config(quick)
  c.methods = ("dense", "quest") + NEW_SPARSE_DECODE
  c.pairs = tuple((m, "quest") for m in NEW_SPARSE_DECODE)
  if quick:
    c.methods = ("dense", "quest") + NEW_SPARSE_DECODE
  return c
