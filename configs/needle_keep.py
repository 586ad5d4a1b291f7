r"""Why Expected Attention misses needles: which tokens each method keeps (EA Fig. 3 diagnosis).

  python -m experiments.needle_keep --config=configs/needle_keep.py --workdir=results/needle_keep
  python -m experiments.needle_keep --config=configs/needle_keep.py --config.quick=True \
      --workdir=/tmp/needle_keep_quick

On the needle grid (``configs/niah_heatmap.py``) Expected Attention found the needle only at
depth >= 0.8. This prefills the same kind of prompt (``niah_single_2``, 2k tokens, the context
before the question) and reads which positions every method keeps at 50% per layer and kv head:
the share of the needle's tokens kept, and the kept share of each tenth of the context. The
Expected Attention variants separate its parts: the paper's needle setting (eps = 0, RoPE
averaged over the next 512 positions, covariance, Ada-KV), the RoPE average over 1 position
(the next one only), no covariance term, uniform head budgets, and the paper's setting for
every other benchmark (``expected-attention``: eps = 0.01, where the value norm dominates the
score of a long prompt's keys, PROTOCOL_NOTES).

Samples: 10 depths x 2 seeds = 20 prompts per method (all methods read one shared prefill).
Cost (2 cores, idle): ~25 s of prefill per 2k prompt (~8 min) plus one eviction per method.
"""

from configs import accuracy

EA = "expected-attention:eps=0"


def get_config(quick: bool = False):
  c = accuracy.get_config(False)
  c.quick = quick
  c.methods = (EA, EA + ",n_future=1", EA + ",use_covariance=False",
               EA + ",head_budget=uniform", "snapkv", "keydiff", "tova", "knorm",
               "streaming_llm", "expected-attention")
  c.budgets = (0.5,)
  c.pairs = ()
  c.tasks = ("niah_single_2",)
  c.lengths = (2048,)
  c.depths = tuple(round(0.05 + 0.1 * i, 2) for i in range(10))
  c.num_samples = 20
  c.batch_size = 5
  if quick:
    c.model = "tiny-random"
    c.methods = (EA, EA + ",n_future=1", "snapkv")
    c.lengths = (256,)
    c.depths = (0.2, 0.8)
    c.num_samples = 2
    c.batch_size = 2
  return c
