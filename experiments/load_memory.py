r"""Peak host memory of loading a bfloat16 Hugging Face checkpoint, against its size.

  python -m experiments.load_memory                            # Llama-3.1-8B's layout, ~0.6 GB
  python -m experiments.load_memory --shape=llama-3.1-8b --full  # the real 16 GB shape

Writes a synthetic sharded checkpoint (``models.synthetic_checkpoint``) into a temporary
directory (or ``--dir``), then loads it with ``models.load(dir, dtype=...)`` in a fresh Python
process and reads that process's ``VmHWM`` (peak resident set, ``/proc/self/status``) once jax
is up (the baseline) and after the params are placed. Prints one JSON line: the checkpoint's
tensor bytes, both peaks, the resident set after loading and
``ratio = (peak - baseline) / checkpoint bytes``: 1.0 when the loader holds the weights once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS

# Llama-3.1-8B's layout (GQA 4:1, head_dim 128, SwiGLU 3.5x, untied head) at 1/26 of its
# weights: a checkpoint of ~0.6 GB that a loader test reads in seconds.
SMALL = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=16,
             num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=32000)

# Runs in a fresh interpreter, in the checkout measured (its ``models`` first on sys.path).
_CHILD = r"""
import json, sys, time
def status():
  with open("/proc/self/status") as f:
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f
            if l.startswith(("VmHWM", "VmRSS"))}
import jax, jax.numpy as jnp
import models
jnp.zeros(8).block_until_ready()
base = status()["VmHWM"]
t = time.perf_counter()
model = models.load(sys.argv[1], dtype=sys.argv[2])
jax.block_until_ready(model.params)
seconds = time.perf_counter() - t
s = status()
print(json.dumps({"baseline_bytes": base, "peak_bytes": s["VmHWM"], "rss_after_bytes": s["VmRSS"],
                  "load_seconds": round(seconds, 2)}))
"""


def define_flags() -> None:
  """The script's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_string("shape", "llama-3.1-8b", "A models.shapes name.")
  flags.DEFINE_bool("full", False, "The shape as it is (else SMALL's sizes in its layout).")
  flags.DEFINE_string("dtype", "bfloat16", "Checkpoint and load dtype.")
  flags.DEFINE_integer("max_shard_mb", 200, "Shard size of the checkpoint written (MB).")
  flags.DEFINE_string("dir", None, "Write the checkpoint here and keep it (default: a "
                      "temporary directory, removed).")


def small_config(shape: str = "llama-3.1-8b", full: bool = False) -> dict:
  """The ``config.json`` dict of ``shape``, scaled to ``SMALL``'s sizes unless ``full``."""
  from models import shapes  # pylint: disable=g-import-not-at-top
  cfg = shapes.hf_config(shape)
  return cfg if full else {**cfg, **SMALL}


def measure(path: str, dtype: str = "bfloat16", root: str | None = None) -> dict:
  """Loads the checkpoint at ``path`` in a fresh process; its memory (see the module doc).

  Args:
    path: an HF directory.
    dtype: the load dtype.
    root: the checkout whose ``models`` is measured (default this one; another revision's
      tree, e.g. from ``git archive``, measures that revision's loader).
  """
  root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(path), dtype],
                       capture_output=True, text=True, check=False, cwd=root)
  if run.returncode:
    raise RuntimeError(f"loading {path} failed:\n{run.stderr[-3000:]}")
  return json.loads(run.stdout.strip().splitlines()[-1])


def write_and_measure(hf_config: dict, path: str, dtype: str = "bfloat16",
                      max_shard_bytes: int = 200 << 20) -> dict:
  """Writes a synthetic checkpoint of ``hf_config`` into ``path``, loads it (``measure``) and
  returns the record with ``checkpoint_bytes`` and ``ratio``."""
  from models import synthetic_checkpoint  # pylint: disable=g-import-not-at-top
  t = time.perf_counter()
  size = synthetic_checkpoint.write(hf_config, path, dtype=dtype, max_shard_bytes=max_shard_bytes)
  rec = {"checkpoint_bytes": size, "write_seconds": round(time.perf_counter() - t, 2),
         **measure(path, dtype)}
  rec["ratio"] = round((rec["peak_bytes"] - rec["baseline_bytes"]) / size, 3)
  return rec


def main(argv):
  del argv
  cfg = small_config(FLAGS.shape, FLAGS.full)
  if FLAGS.dir:
    rec = write_and_measure(cfg, FLAGS.dir, FLAGS.dtype, FLAGS.max_shard_mb << 20)
  else:
    with tempfile.TemporaryDirectory(prefix="load_memory-") as tmp:
      rec = write_and_measure(cfg, tmp, FLAGS.dtype, FLAGS.max_shard_mb << 20)
  print(json.dumps({"shape": FLAGS.shape, "full": FLAGS.full, "dtype": FLAGS.dtype, **rec}))


if __name__ == "__main__":
  define_flags()
  app.run(main)
