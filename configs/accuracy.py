r"""Retrieval accuracy of RESA, ReSA and RetroAttention on Qwen at 4k and 8k (RESA Table 1).

  python -m experiments.accuracy --config=configs/accuracy.py --workdir=results/accuracy
  # the most important cells first (each part resumes and appends to the same workdir):
  python -m experiments.accuracy --config=configs/accuracy.py --workdir=results/accuracy \
      "--config.methods=('dense','quest','resa-quest')" "--config.budgets=(0.025,)" \
      "--config.lengths=(4096,)"
  python -m experiments.accuracy --config=configs/accuracy.py --workdir=results/accuracy \
      "--config.lengths=(4096,)"
  python -m experiments.accuracy --config=configs/accuracy.py --config.quick=True  # CI smoke

Protocol (RESA Sec. 5, "Additional Configuration"): ``qwen2.5-coder-0.5b-instruct`` (dense
100% at 4k), RESA's RULER task mix, the question prefilled with the context (query-aware), greedy
answers scored by RULER's string match. Rows: dense; quest / arkvale / topk with and without RESA
(presets ``resa-quest`` ...: budget = tokens chosen by the selector, 4 sinks + 64 local tokens on
top, prior fixed at prefill end, lam = 1) at 2.5 / 5 / 10% of the context; ReSA's ``rectified``
preset at p = 0.1 / 0.05 / 0.02 (f = 32, group-shared selection, n_min = 16); RetroAttention's
``retro`` preset (b = 0.15, 256-token minimum, w = 2). Pairs "+RESA vs its selector" are
reported on the same samples with a paired bootstrap interval and McNemar's test. A method
``spec@b`` runs at budget ``b`` only: RESA's lambda rows beside the grid (2026-11-26, 8k),

  "--config.methods=(..., 'resa-quest:lam=0.25@0.025', 'resa-quest:lam=0.5@0.025')"
  "--config.pairs=(..., ('resa-quest:lam=0.25', 'quest'), ('resa-quest:lam=0.5', 'quest'))"

feed the claim row "RESA with lam chosen on held-out tasks" (``experiments.claims.held_out``).
A per-head lambda fitted on a novel by ``experiments.resa_calibrate`` (Qwen, the ``resa-quest``
preset at 2.5%, an 8k prompt of ``emma``; its workdir's ``calibration_lambda`` folder) runs as
its own row, paired with Quest, for the claim row "per-head lam fitted on a novel":

  "--config.methods=('quest', 'resa-quest+calibrated:fit=results/resa_calibrate_qwen/calibration_lambda@0.025')"
  "--config.pairs=(('resa-quest+calibrated:fit=results/resa_calibrate_qwen/calibration_lambda', 'quest'),)"

Samples: ``num_samples`` = 5 per (task, length) over 12 tasks, so every method x budget x length
average (the headline cell) holds 60 samples (5 per task cell). The tasks are generated as
NVIDIA/RULER generates them (``experiments.tasks.ruler``): needles at RULER's random positions,
RULER's prompts, one-shot examples and generation caps (128 tokens for NIAH answers).

Cost on this machine (2 cores), measured 2026-11-25 with two processes split by task, one core
each: a batch of 5 prompts of 4096 tokens takes ~190-250 s of shared prefill, then ~5-35 s of
greedy decoding per row (RetroAttention and the long-answer tasks cwe / vt / multivalue at the
top); 7 rows x 60 samples took 38 min. The whole 4k grid (23 rows) is then ~1.2 h; 8k,
estimated at ~2.5x the prefill and ~2x the decoding, ~3 h. Memory at 8k, one process holding
5 rows x a batch of 5: 11.8 GB resident at first (2026-11-25: two such processes exhausted
24 GiB, one was OOM-killed); 7.2 GB once the prefill kept the decode layout (no cache copy at
its end) and freed buffers went back to the OS (``experiments.common.heap``); the run now also
keeps one copy of the weights (``Model.in_decode_layout``: -1.4 GB for Qwen in float32; at 2k
the five rows' steady resident memory went 5.9 -> 3.5 GB). Two 8k processes fit in 24 GiB.
The progress line prints the measured rate and ETA within the first batch; run the grid in
slices (methods, budgets, tasks and lengths are keyed, so slices resume and extend one another).
"""

from ml_collections import config_dict

RESA_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
              "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt",
              "cwe", "fwe", "qa")


def get_config(quick: bool = False):
  c = config_dict.ConfigDict()
  c.quick = quick
  c.model = "qwen2.5-coder-0.5b-instruct"
  c.protocol = "query_aware"
  c.methods = ("dense", "quest", "resa-quest", "arkvale", "resa-arkvale", "topk", "resa-topk",
               "rectified", "rectified:p=0.05", "rectified:p=0.02", "retro")
  c.budgets = (0.025, 0.05, 0.1)
  c.pairs = (("resa-quest", "quest"), ("resa-arkvale", "arkvale"), ("resa-topk", "topk"))
  c.block_size = 16
  c.tasks = RESA_TASKS
  c.lengths = (4096, 8192)
  c.num_samples = 5
  c.depths = ()  # empty: RULER's random needle positions; values pin the queried needle
  c.seed = 0
  c.haystack = "essays"  # essay haystack text: essays (Paul Graham) | austen | a novel
  c.chat = True
  c.batch_size = 5
  c.max_new_tokens = 0  # 0: the task's own (ruler.MAX_NEW_TOKENS)
  # Compacted caches sized to 2 significant bits (at most 25% more slots): layers and batches
  # that keep nearby counts (PyramidKV, KVzip's model-wide ranking) share compiled programs
  # (CompressionMethod.capacity_bits); False: exact sizes.
  c.bucket_capacity = True
  c.heatmap = False
  if quick:
    c.model = "tiny-random"
    c.methods = ("dense", "quest", "resa-quest", "rectified", "retro")
    c.budgets = (0.1,)
    c.tasks = ("niah_single_1", "qa")
    c.lengths = (320,)
    c.num_samples = 2
    c.batch_size = 2
    c.max_new_tokens = 6
  return c
