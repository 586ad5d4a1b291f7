"""ThinK's ``ThinKCache`` (and the token press + ThinK composition's) on a device mesh: every
leaf gets ``STATE_AXES``'s partition spec, kv heads over ``model`` as a ``KVCache``'s (the
pruned prompt part, the decode part and the kept channel ids ``[B, K, D']``), slots over
``seq``, and (ThinK's) a decode step on the placed cache equals one device's.

A mesh of 4 CPU devices needs ``XLA_FLAGS`` before jax starts: the check runs in its own
interpreter (as ``test_sharding.py``'s ``sharded_cases.py``), a few seconds.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r'''
import json
import jax, jax.numpy as jnp, numpy as np
from models import sharding
from sparse_attn import methods
from sparse_attn.compression.think import ThinKCache

B, HQ, HKV, D, L, T = 2, 4, 2, 16, 32, 48
rng = np.random.default_rng(0)
f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
q, k, v = f(B, HQ, L, D), f(B, HKV, L, D), f(B, HKV, L, D)
pos = jnp.tile(jnp.arange(L), (B, 1))
mesh = sharding.make_mesh(data=1, model=2, seq=2)
out = {}
for spec in ("think", "snapkv:window_size=8+think"):
  m = methods.make(spec + ":ratio=0.5,window_size=8", ratio=0.5)
  cache, state = m.init_cache(B, HKV, T, D), m.init_state(B, HQ, HKV, D, T)
  _, cache, state = jax.jit(m.prefill)(q, k, v, cache, state, pos)
  cache, state = m.end_prefill(cache, state)
  assert isinstance(cache, ThinKCache), type(cache)
  placed = sharding.place(cache, mesh)
  err = 0.0
  if spec == "think":  # a decode step on the placed cache equals one device's
    step = (f(B, HQ, 1, D), f(B, HKV, 1, D), f(B, HKV, 1, D), cache, state, jnp.full((B, 1), L))
    decode = jax.jit(m.decode)
    got = decode(*step[:3], placed, sharding.place(state, mesh), step[-1])[0]
    err = float(jnp.max(jnp.abs(got - decode(*step)[0])))
  leaves = jax.tree_util.tree_leaves_with_path(placed)
  out[spec] = dict(
      specs={jax.tree_util.keystr(p): [x.shape, list(x.sharding.spec)] for p, x in leaves},
      smaller={jax.tree_util.keystr(p): all(s.data.size < x.size for s in x.addressable_shards)
               for p, x in leaves if x.size},
      err=err)
print("RESULT " + json.dumps(out))
'''


def _run_child():
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
  line = next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


def test_thinkcache_leaves_are_sharded_like_a_kvcache():
  for spec, res in _run_child().items():
    specs = res["specs"]
    names = {p.split(".")[-1] for p in specs}
    assert {"k", "v", "pos", "channels"} <= names, specs
    for path, (shape, axes) in specs.items():
      if len(shape) < 2:
        continue  # length [B]: batch only (data: 1)
      # [B, K, ...]: kv heads over model, as KVCache's k / v / pos
      assert len(axes) >= 2 and axes[1] == "model", (spec, path, shape, axes)
    for part in ("prompt", "recent"):
      shape, axes = specs[f".{part}.k"]
      assert axes[:3] == [None, "model", "seq"] or shape[2] % 2, (spec, part, shape, axes)
    assert res["smaller"][".channels"] and res["smaller"][".prompt.k"], (spec, res["smaller"])
    assert res["err"] < 1e-5, (spec, res["err"])
