r"""Memory plan of sharded decoding: bytes per device, computed from the code's own layouts.

  python -m experiments.memory_plan --out=docs/sharding.md

Llama-3.1-8B (32 layers, 32 query / 8 kv heads, head dim 128, bf16) at a 128k-token cache,
batch 8, on 8 devices (8 x H100 80 GB). Nothing is allocated: parameter, cache and method-state
shapes come from ``jax.eval_shape`` of ``llama.init_params`` and each method's ``init_cache`` /
``init_state``, and each leaf is divided by the mesh axes that ``models.sharding``'s logical-axis
tables split it over (an axis that does not divide a dimension leaves it replicated, exactly as
at run time). Writes the markdown page (the layout, the API, the tables).
"""

from __future__ import annotations


import dataclasses
import jax
from absl import app, flags

from models import llama, sharding
from models.config import ModelConfig, RopeConfig
from sparse_attn import cache as cache_lib
from sparse_attn import methods

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "docs/sharding.md", "Markdown file to write.")
flags.DEFINE_integer("context", 131072, "Cache capacity (tokens per sequence).")
flags.DEFINE_integer("batch", 8, "Sequences decoded together.")
flags.DEFINE_integer("decode_room", 1024, "Generated tokens the cache leaves room for.")

LLAMA_31_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                          rope=RopeConfig(theta=500000.0), max_position_embeddings=131072,
                          dtype="bfloat16")
LAYOUTS = ["data:8", "model:8", "seq:8", "data:2,model:4", "model:2,seq:4",
           "data:2,model:2,seq:2", "data:1"]
METHODS = {
    "dense": lambda: methods.make("dense"),
    "quest (sparse)": lambda: methods.make("quest", budget=0.1),
    "quest+resa": lambda: methods.make("quest+resa", budget=0.1),
    "quest+retro": lambda: methods.make("quest+retro", budget=0.1),
    "expected_attention 0.5": lambda: methods.make("expected_attention", ratio=0.5),
}
DIGESTS = cache_lib.DIGEST_FIELDS
GIB = 1024 ** 3
H100_BYTES = 80 * 1000 ** 3


def _parts(config, method, batch: int, context: int, decode_room: int):
  """Abstract per-layer ``{part: tree}``: cache (K, V, positions), digests, RESA prior, state."""
  cap = method.decode_capacity(context, decode_room)
  dt = llama.compute_dtype(config)
  cache = jax.eval_shape(lambda: method.init_cache(batch, config.num_kv_heads, cap,
                                                   config.head_dim, dt))
  state = jax.eval_shape(lambda: method.init_state(batch, config.num_heads, config.num_kv_heads,
                                                   config.head_dim, cap, dt))
  fields = {f: getattr(cache, f) for f in ("k", "v", "pos", "length") + DIGESTS}
  if isinstance(state, dict):  # a compression method's counters and scorer parts
    resa, rest = state.get("resa"), {k: v for k, v in state.items() if k != "resa"}
  else:  # a Method's MethodState: RESA's part, and the rest (retro's)
    resa, rest = state.resa, dataclasses.replace(state, resa=None)
  return {"cache": {f: fields[f] for f in ("k", "v", "pos", "length")},
          "digests": {f: fields[f] for f in DIGESTS},
          "resa prior": resa if resa is not None else {},
          "method state": rest}


def plan(config=LLAMA_31_8B, batch=8, context=131072, decode_room=1024):
  """Rows ``{layout, method, weights, cache, digests, resa prior, method state, total}``
  (bytes per device)."""
  params = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
  rows = []
  for layout in LAYOUTS:
    sizes = sharding.parse_mesh(layout)
    weights = sharding.planned_bytes(params, sizes, kind="param")
    for name, make in METHODS.items():
      parts = _parts(config, make(), batch, context, decode_room)
      row = dict(layout=layout, method=name, weights=weights)
      for part, tree in parts.items():
        row[part] = config.num_layers * sharding.planned_bytes(tree, sizes)
      row["total"] = sum(v for k, v in row.items() if k not in ("layout", "method"))
      rows.append(row)
  return rows


COLUMNS = ("weights", "cache", "digests", "resa prior", "method state", "total")


def table(rows) -> str:
  head = "| mesh | method | " + " | ".join(COLUMNS) + " | fits 80 GB |"
  lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
  for r in rows:
    cells = " | ".join(f"{r[c] / GIB:.2f}" for c in COLUMNS)
    lines.append(f"| {r['layout']} | {r['method']} | {cells} | "
                 f"{'yes' if r['total'] < H100_BYTES else 'no'} |")
  return "\n".join(lines)


INTRO = """# Sharding: tensor-parallel model, head- and sequence-sharded caches

A mesh has three axes: `data` (batch), `model` (attention heads and MLP hidden; the embedding
and LM head over the vocabulary) and `seq` (the cache's slots, and with them the block digests and
RESA's prior logits). `models/sharding.py` holds the one logical-axis table every array is laid
out by; an axis that does not divide a dimension leaves it replicated, so every mesh runs every
model and gives one device's numbers.

```python
import models
from sparse_attn import methods
mesh = models.make_mesh(data=2, model=2, seq=2)          # axes data, model, seq
model = models.shard(models.load(), mesh)                 # parameters placed (tensor parallel)
out = models.generate(model, ids, 64, methods.make("quest+resa"), mesh=mesh)
logits = models.teacher_forced(model, tokens, 512, methods.make("quest"), mesh=mesh)
```

Every experiment that decodes with a model (`experiments.accuracy`, `resa_lambda`,
`budget_reduction`, `perplexity`, `long_generation`, `generate`, `shard_memory`) takes
`--mesh=data:2,model:2,seq:2`, and `--distributed`, which calls `jax.distributed.initialize()`
(coordinator address, process count and id from the environment: `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, or SLURM / Open MPI). The mesh is not part of a run's
config: its records are one device's, so a run may resume on another mesh. The experiments'
shared prefills (one dense prefill for every selector method, one for every compression method)
build their union from the plain methods and wrap it for the mesh where it runs
(`experiments/tasks/decoding.py`).

**Context-parallel sparse decode** (`sparse_attn/context_parallel.py`, under `jax.shard_map`,
whenever `seq > 1`): each device holds a slice of the cache and its digests; block scores are
local; each shard keeps its best candidates, which are all-gathered for one final top-k (the
selected set equals one device's); each device attends its own selected blocks and the per-shard
`(out, lse)` are merged exactly (`sparse_attn.merge`). RESA's prior (`Z`, the numerator of
`O_est`, the key sum) is reduced across shards when it is formed, and the shard that owns a newly
written slot updates it. This covers Quest and ArkVale with fixed budgets, with or without RESA
and rectification. Retro windows, adaptive budgets (`topp`, `adakv`), token-level selectors and
compression methods run under GSPMD on the same sharded arrays (equal to one device as well).
Rectification's dense pass always runs under GSPMD.

Tested (`tests/models/sharded_cases.py`, 8 virtual CPU devices, run in its own process by
`tests/models/test_sharding.py`): teacher-forced logits of the tiny random model equal one
device's (<= 1e-5 relative, f32) for dense, quest, quest+resa, rectified
(`quest:gqa=group` with `p=0.1` + `rect`), quest+retro and expected_attention (0.5) on the
(data, model, seq) meshes (2,2,2), with quest+resa on all of (8,1,1), (1,8,1), (1,2,4), (2,2,2)
and the other pairs spread over them in CI; `SHARDING_FULL_MATRIX=1` runs all 24 pairs. The
experiments' loops are tested the same way on (2,2,2): the lockstep teacher forcing behind the
perplexity experiment (shared dense prefill for quest+resa and quest+retro, a compression union
of expected_attention and snapkv) and the prefill / query-agnostic read / greedy path behind the
accuracy experiment give one device's NLL and tokens. Cache,
digest and RESA-prior leaves are checked to be split (each device's shard smaller than the
array). `python -m experiments.shard_memory` measures the bytes each of 8 virtual devices holds:
with `--mesh=seq:8` it is 1/8 of one device's cache.

Not verified here: real multi-host runs (`--distributed`), real accelerators (the Pallas kernels
inside `shard_map`), and interconnect speed (per layer and decode step the context-parallel path
all-gathers each shard's top-k candidates and its `(out, lse)`; GSPMD inserts its own collectives
for the rest).
"""


def page(rows, config, batch, context) -> str:
  return (INTRO + f"\n## Memory plan (generated by `python -m experiments.memory_plan`)\n\n"
          f"Llama-3.1-8B ({config.num_layers} layers, {config.num_heads} query / "
          f"{config.num_kv_heads} kv heads, head dim {config.head_dim}, bf16), a {context}-token "
          f"cache, batch {batch}, on 8 devices. GiB per device. `cache` = K, V and slot "
          f"positions; `digests` = Quest/ArkVale block digests (block 16, kept by every method's "
          f"cache); `resa prior` = RESA's prior logits `[B, N, T]` f32 and statistics; "
          f"`method state` = retro's ring and seen-blocks table, Expected Attention's query "
          f"buffer. Expected Attention at 0.5 keeps half of the prompt (cache shrunk after "
          f"prefill). `data:1` is one device, for reference.\n\n" + table(rows) + "\n")


def main(argv):
  del argv
  rows = plan(LLAMA_31_8B, FLAGS.batch, FLAGS.context, FLAGS.decode_room)
  text = page(rows, LLAMA_31_8B, FLAGS.batch, FLAGS.context)
  with open(FLAGS.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(table(rows))


if __name__ == "__main__":
  app.run(main)
