r"""kvpress's RULER leaderboard for the compression methods kvpress runs, on Qwen.

  # query-agnostic panel (kvpress: the context compressed before the question is seen)
  python -m experiments.accuracy --config=configs/leaderboard_compression.py \
      --workdir=results/leaderboard_compression "--config.lengths=(4096,)"
  # query-aware panel (the question inside the compressed prompt: SnapKV, FINCH, ChunkKV)
  python -m experiments.accuracy --config=configs/leaderboard_compression_qa.py \
      --workdir=results/leaderboard_compression_qa "--config.lengths=(4096,)"

kvpress's leaderboard (``evaluation/leaderboard.sh``): RULER at 4k, compression ratios 0.25 /
0.5 / 0.75 / 0.875, i.e. kept fractions 0.75 / 0.5 / 0.25 / 0.125 (``budgets`` here: the
fraction kept). Rows per panel, as kvpress runs them:

* query-agnostic: the methods of ``results/ruler_compression`` are there at 0.75 / 0.5 /
  0.25 / 0.1 (EA Table 1's grid), so this run adds their 0.125 cell and every method new to
  the library at all four fractions: random, CUR, LagKV, Compactor with Ada-KV head budgets
  (kvpress's ``adakv_compactor``), Q-Filters, PyramidKV, DuoAttention on the fly, KVzip and
  KVzip+ (kvpress's ``kvzip_plus``: ``kvzip:plus=true``), kvpress's observed attention (H2O's
  sums as a mean, no recent window), KeyDiff cut block by block (kvpress's ``block_keydiff``,
  ``BlockPress(KeyDiffPress(), block_size=128)``: ``keydiff:prompt_block=128``), kvpress's
  ``merging_knorm`` / ``merging_snapkv`` / ``merging_expected_attention`` (``merge=true``), and
  CriticalKV / CriticalAdaKV and ThinK (not on kvpress's board; ours beside them). ThinK
  evicts no token: its kept fraction is of the key channels (kvpress's
  ``key_channel_compression_ratio`` = ``1 - kept``), so its cache holds ``(1 + kept) / 2`` of
  the dense bytes. kvpress's ``duo_attention`` (trained patterns) and ``kvzap`` (a trained
  scorer) are out of scope.
* query-aware: SnapKV, Ada-KV SnapKV, FINCH and ChunkKV with the question in the window.
  FINCH runs as kvpress's ``FinchPress`` (kept keys re-rotated to consecutive positions, its
  default) and with ``rerotate_keys=false`` (positions kept, as every other row), paired: what
  the re-rotation does. ChunkKV runs also with the paper's layer-wise index reuse
  (``reuse_layers=2``, Algorithm 2; kvpress has none), paired with ChunkKV alone: the paper's
  Table 9 finds the reuse within 0.6% of it.

Same task mix, samples and generator as ``configs/accuracy_compression.py`` (12 RULER tasks x
5 samples = 60 per cell, NVIDIA/RULER's generator, greedy answers, string match); one shared
prefill per batch serves every row (``experiments.tasks.compression_union``); dense reads the
same cache. Pairs: each new method against SnapKV, the board's reference row (run here at
all four fractions). Pairs are by sample: a method rerun after a fix pairs with SnapKV's cells
of an earlier run on the same samples; SnapKV's and dense's predictions repeat exactly across
runs and revisions (results/ruler_compression's shared cells; a test over the records).
"""

from configs import accuracy_compression

KEPT = (0.75, 0.5, 0.25, 0.125)  # kvpress's ratios 0.25 / 0.5 / 0.75 / 0.875
NEW_QUERY_AGNOSTIC = ("random", "cur", "lagkv", "compactor:head_budget=adakv", "qfilters",
                      "pyramidkv", "duo_attention_on_the_fly", "kvzip", "criticalkv",
                      "criticaladakv", "observed_attention", "think", "keydiff:prompt_block=128",
                      "kvzip:plus=true", "knorm:merge=true", "snapkv:merge=true",
                      "expected_attention:head_budget=uniform,eps=0.01,merge=true")
QUERY_AWARE = ("snapkv", "snapkv:head_budget=adakv", "finch", "chunkkv",
               "finch:rerotate_keys=false", "chunkkv:reuse_layers=2")


def get_config(quick: bool = False, panel: str = "query_agnostic"):
  """The ``panel`` (``query_agnostic`` or ``query_aware``) of kvpress's board."""
  if panel not in ("query_agnostic", "query_aware"):
    raise ValueError(f"panel must be query_agnostic or query_aware, got {panel!r}")
  c = accuracy_compression.get_config(quick)
  c.protocol = panel
  c.budgets = KEPT
  if panel == "query_agnostic":
    older = tuple(m for m in c.methods if m not in ("dense", "snapkv"))
    c.methods = (("dense",) + NEW_QUERY_AGNOSTIC + ("snapkv",)  # the pairs' reference
                 + tuple(f"{m}@0.125" for m in older))  # their other cells: ruler_compression
    c.pairs = tuple((m, "snapkv") for m in NEW_QUERY_AGNOSTIC)
  else:
    c.methods = ("dense",) + QUERY_AWARE
    c.pairs = tuple((m, "snapkv") for m in QUERY_AWARE[1:]) + (
        ("finch", "finch:rerotate_keys=false"), ("chunkkv:reuse_layers=2", "chunkkv"))
  if quick:
    c.budgets = (0.5,)
    c.methods = tuple(m for m in c.methods if "@" not in m)
  return c
