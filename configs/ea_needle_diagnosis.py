r"""Expected Attention's needle miss at eps = 0: its expected score against the true attention.

  python -m experiments.ea_needle_diagnosis --config=configs/ea_needle_diagnosis.py \
      --workdir=results/ea_needle_diagnosis
  python -m experiments.ea_needle_diagnosis --config=configs/ea_needle_diagnosis.py \
      --config.quick=True --workdir=/tmp/ea_needle_diagnosis_quick

The setting of ``configs/needle_keep.py`` (``niah_single_2``, Qwen2.5-Coder-0.5B, 2k tokens,
50%): one prompt per pinned needle depth, shallow (0.1, 0.2), middle (0.5) and deep (0.8, 0.9).
For every layer and kv head, Expected Attention's score of every context key (the paper's
needle setting, ``expected-attention:eps=0``) is compared with the dense attention the
question's tokens pay that key (issue 40, item 5). ``check_pipeline`` also runs the method's
own prefill + eviction (``decoding.prefill_all``) and records how often its kept set agrees
with the one recomputed here (the diagnosis reads what the method really keeps).

Cost (2 cores, idle): ~25 s dense capture + ~25 s pipeline prefill per 2k prompt (~5 min).
"""

from configs import accuracy


def get_config(quick: bool = False):
  c = accuracy.get_config(False)
  c.quick = quick
  c.method = "expected-attention:eps=0"
  c.budget = 0.5
  c.methods = ()
  c.budgets = ()
  c.pairs = ()
  c.tasks = ("niah_single_2",)
  c.lengths = (2048,)
  c.depths = (0.1, 0.2, 0.5, 0.8, 0.9)
  c.num_samples = 5  # sample i pins the needle at depths[i % len(depths)]
  c.check_pipeline = True
  if quick:
    c.model = "tiny-random"
    c.lengths = (256,)
    c.depths = (0.2, 0.8)
    c.num_samples = 2
  return c
