"""``--mesh`` and ``--distributed`` for the entry points that decode with a model.

Defined by ``cli.define_flags(NAME, mesh=True)`` (accuracy, resa_lambda, budget_reduction,
perplexity, long_generation) and directly by ``generate`` and ``shard_memory``:

  python -m experiments.generate --mesh=data:2,model:2,seq:2
  python -m experiments.perplexity --mesh=seq:8 --distributed    # one process per host
  python -m experiments.accuracy --config=configs/accuracy.py --mesh=data:2,model:4

``--distributed`` calls ``jax.distributed.initialize()`` before anything touches a device; with
no arguments JAX reads the coordinator address, process count and process id from the usual
environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, or a
cluster's own: SLURM, Open MPI, Cloud TPU). The mesh then spans the devices of every process.
"""

from __future__ import annotations

from absl import flags

FLAGS = flags.FLAGS


def define_flags():
  """Defines ``--mesh`` and ``--distributed`` (once; safe to call from several modules)."""
  if "mesh" in FLAGS:
    return
  flags.DEFINE_string("mesh", None, "Device mesh NAME:SIZE,... over the axes data (batch), "
                      "model (heads, MLP) and seq (cache slots), e.g. data:2,model:2,seq:2. "
                      "Unset: one device.")
  flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() first (multi-host; "
                    "coordinator and process ids from the environment).")


def mesh_from_flags():
  """The ``--mesh`` (after ``jax.distributed.initialize()`` with ``--distributed``), or None."""
  if FLAGS.mesh is None and not FLAGS.distributed:
    return None  # without importing JAX: a config error after this comes in a blink
  import jax  # pylint: disable=g-import-not-at-top

  from models import sharding  # pylint: disable=g-import-not-at-top
  if FLAGS.distributed:
    jax.distributed.initialize()
  return sharding.mesh_from_text(FLAGS.mesh)
