r"""The papers' efficiency claims on one GPU in one command (issue 51, items 3-6).

On the lent GPU (the device tool's ``run``, ``carry=[".whl"]``, ``timeout_s=590``), after
``bash experiments/gpu_claims.sh prepare`` here (commit first)::

  EXPERIMENT_REVISION=<sha> EXPERIMENT_TREE_HASH=<hash> bash experiments/gpu_claims.sh

which runs

  XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.latency \
      --config=configs/latency_gpu_claims.py --workdir=$OUT/gpu_claims

Section ``paper`` (``experiments/latency_lib/paper_runs.py``) runs ``plan``'s items in order
until ``paper_deadline_s``; a rerun (or the next session, seeded from the committed records)
resumes. Estimated seconds on one H100 (model builds, compilation ~5-15 s per part, the timed
tokens; none measured yet):

1. ``retro@32768x8``: Retro Table 6's worst case, w = 0/8/2/4, 1,024 tokens each (~120 s);
2. ``batch@32768x8``: dense, Quest, +RESA at batch 8 (~45 s);
3. ``retro@32768x1``: Table 6 at batch 1 (~80 s);
4. ``resa_e2e@262144 ... @4096``: ReSA Fig. 7 on R1-Distill-Qwen-7B, dense vs rectified (~100 s);
5. ``resa_kernels@262144/65536/16384``: ReSA Fig. 6, one layer's estimation / attention /
   rectification next to dense (~50 s);
6. ``resa_e2e:qwen3-1.7b@262144``: Fig. 7 at 256K on the model of ReSA's Sec. 3.4 (~25 s);
7. ``retro@65536x4``, ``retro@131072x2``: Table 6's longer contexts (~240 s; a second session).

CI: ``get_config(quick=True)`` runs one item of each study on the ``tiny`` shape in seconds
(tests/experiments/test_gpu_claims.py; numbers meaningless).
"""

from configs import latency_gpu

PLAN = ",".join([
    "retro@32768x8", "batch@32768x8", "retro@32768x1",
    "resa_e2e@262144", "resa_e2e@65536", "resa_e2e@16384", "resa_e2e@4096",
    "resa_kernels@262144", "resa_kernels@65536", "resa_kernels@16384",
    "resa_e2e:qwen3-1.7b@262144", "retro@65536x4", "retro@131072x2",
])

_QUICK = dict(
    plan="retro@64x1,batch@64x2,resa_e2e@64,resa_kernels@64", retro_windows="0,2",
    retro_decode_steps=2, retro_repeats=1, batch_methods="dense", resa_shape="tiny",
    resa_spec="rectified", paper_deadline_s=0.0, steps_per_call=1, warmup=0, repeats=2,
    shape_repeats=1, shape_decode_steps=2,
)


def get_config(quick: bool = False):
  c = latency_gpu.get_config(quick)
  c.sections = "paper"
  c.plan = PLAN  # study[:shape]@CONTEXT[xBATCH], in priority order
  c.retro_windows = "0,8,2,4"  # w = 0: the retro preset's Quest alone
  c.retro_decode_steps = 256  # x retro_repeats = the 1,024 tokens Table 6 averages over
  c.retro_repeats = 4
  c.batch_methods = "dense,quest:gqa=group,quest:gqa=group+resa"
  c.resa_shape = "r1-distill-qwen-7b"
  c.resa_spec = "rectified"  # block 16, p = 0.1 (keep 10%), n_min 16, f = 32
  c.paper_deadline_s = 480.0  # no part starts after this (0 = none)
  c.shape_transformers = False
  c.shape_part_timeout_s = 150.0
  c.max_seconds_per_context = 20.0
  if quick:
    c.update(_QUICK)
  return c
