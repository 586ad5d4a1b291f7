r"""Per-device cache bytes of sharded decoding, measured on 8 virtual CPU devices.

  python -m experiments.shard_memory                      # seq:8, data:8, model:8, 2x2x2
  python -m experiments.shard_memory --mesh=seq:8 --method=quest+resa

Builds a random model with SmolLM2-135M's attention geometry (or ``--num_kv_heads`` etc.),
prefills a prompt and runs decode steps with ``mesh=``, then reads the bytes each device really
holds for the caches (K, V, slot positions, digests; the ``length [B]`` vector is replicated) and
the method states from the arrays' shards, next to one device's. With ``--mesh=seq:8`` every device holds 1/8 of the cache.
Sets ``--xla_force_host_platform_device_count=8`` itself when run on a CPU host.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

from absl import app, flags  # pylint: disable=g-import-not-at-top

from experiments.common import distributed  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
distributed.define_flags()
def define_flags() -> None:
  """The script's flags, defined when it runs (importing it defines none)."""
  flags.DEFINE_string("method", "quest+resa", "Method spec.")
  flags.DEFINE_integer("batch", 8, "Rows.")
  flags.DEFINE_integer("prompt", 192, "Prompt tokens.")
  flags.DEFINE_integer("capacity", 256, "Cache capacity (tokens).")
  flags.DEFINE_integer("steps", 2, "Decode steps after the prompt.")
  flags.DEFINE_integer("num_layers", 4, "Layers of the random model.")
  flags.DEFINE_integer("num_heads", 8, "Query heads.")
  flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
  flags.DEFINE_integer("head_dim", 64, "Head dim.")

LAYOUTS = ("seq:8", "data:8", "model:8", "data:2,model:2,seq:2")


def cache_bytes(model, method, mesh) -> tuple[int, int, int]:
  """``(max per-device cache bytes, max per-device state bytes, global cache bytes)`` after
  prefill and ``FLAGS.steps`` decode steps."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from models import decode, driver, sharding  # pylint: disable=g-import-not-at-top
  from sparse_attn import cache as cache_lib  # pylint: disable=g-import-not-at-top
  model, method = sharding.prepare(model, method, mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, model.config.vocab_size, (FLAGS.batch, FLAGS.prompt)).astype(np.int32)
  lengths = np.full((FLAGS.batch,), FLAGS.prompt, np.int32)
  _, history, caches, states = decode.prefill(model, tokens, lengths, method,
                                              method.round_capacity(FLAGS.capacity), 64)
  loop = driver.Decoder(model, method, history, caches, states)
  for i in range(FLAGS.steps):
    loop.step(lengths + i, jax.random.key(i))
  caches, states = loop.caches, loop.states
  # ``length [B]`` is replicated on every device (a few bytes); the rest is split.
  slots = [{f: getattr(c, f) for f in ("k", "v", "pos") + cache_lib.DIGEST_FIELDS}
           for c in caches]
  per_cache = sharding.cache_bytes_per_device(slots)
  per_state = sharding.cache_bytes_per_device(states)
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(slots))
  return max(per_cache.values()), max(per_state.values() or [0]), total


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top

  import models  # pylint: disable=g-import-not-at-top
  from models import llama, sharding  # pylint: disable=g-import-not-at-top
  from models.config import ModelConfig, RopeConfig  # pylint: disable=g-import-not-at-top
  from sparse_attn import methods  # pylint: disable=g-import-not-at-top

  mesh_flag = distributed.mesh_from_flags()
  cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                    num_layers=FLAGS.num_layers, num_heads=FLAGS.num_heads,
                    num_kv_heads=FLAGS.num_kv_heads, head_dim=FLAGS.head_dim,
                    rope=RopeConfig(theta=10000.0))
  model = models.Model(cfg, llama.init_params(cfg, jax.random.key(0)), None, "random")
  method = methods.make(FLAGS.method, block_size=16)
  one_cache, one_state, total = cache_bytes(model, method, None)
  print(f"{FLAGS.method}, batch {FLAGS.batch}, capacity {FLAGS.capacity}, {cfg.num_layers} "
        f"layers, {cfg.num_kv_heads} kv heads, {len(jax.devices())} devices\n")
  print("| mesh | cache bytes / device (K, V, pos, digests) | fraction of one device | "
        "state bytes / device |")
  print("|---|---|---|---|")
  print(f"| one device | {one_cache} | 1 | {one_state} |")
  layouts = [FLAGS.mesh] if mesh_flag is not None else LAYOUTS
  for layout in layouts:
    mesh = sharding.mesh_from_text(layout)
    per_cache, per_state, _ = cache_bytes(model, method, mesh)
    print(f"| {layout} | {per_cache} | 1/{one_cache / per_cache:.3g} | {per_state} |")


if __name__ == "__main__":
  define_flags()
  app.run(main)
