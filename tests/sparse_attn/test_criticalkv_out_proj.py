"""CriticalKV's W^O is held once per layer: ``out_proj [N, D, E]`` in the weights' dtype with
no batch axis (sharded by head), dropped after a prefill-only compression, counted once by the
batch plan; ``||v W^O_h||_1`` over tiles of ``NORM_TILE`` slots equals the one-shot numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import modelzoo
from experiments.tasks import batch_plan
from models import sharding, steps
from sparse_attn import methods
from sparse_attn.cache import init_cache
from sparse_attn.compression import criticalkv

B, HQ, HKV, D, E = 2, 4, 2, 8, 12


def test_projected_norm_in_tiles_equals_numpy():
  t = criticalkv.NORM_TILE + 80  # two tiles, the second padded
  rng = np.random.default_rng(0)
  cache = init_cache(B, HKV, t + 16, D, 16)
  v = rng.normal(size=(B, HKV, t + 16, D)).astype(np.float32)
  cache = dataclasses.replace(cache, v=jnp.asarray(v, jnp.bfloat16))
  wo = rng.normal(size=(HQ * D, E)).astype(np.float32)
  m = methods.make("criticalkv", ratio=0.5)
  state = criticalkv.set_out_proj(m.init_state(B, HQ, HKV, D, t + 16), jnp.asarray(wo, jnp.bfloat16))
  assert state["out_proj"].shape == (HQ, D, E) and state["out_proj"].dtype == jnp.bfloat16
  got = np.asarray(criticalkv.projected_norm(cache, state))
  vb = np.asarray(cache.v, np.float32).repeat(HQ // HKV, axis=1)  # [B, HQ, T, D]
  wb = np.asarray(state["out_proj"], np.float32)  # [HQ, D, E]
  want = np.abs(np.einsum("bhtd,hde->bhte", vb, wb)).sum(-1).reshape(B, HKV, -1, t + 16).mean(2)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_one_copy_per_layer_counted_once():
  model = modelzoo.tiny_random()
  cfg, n, l = model.config, model.config.num_heads, model.config.num_layers
  m = methods.make("criticalkv", ratio=0.5)
  wo_bytes = n * cfg.head_dim * cfg.hidden_size * jnp.dtype(
      model.decode_params["layers"][0]["o_proj"]["kernel"].dtype).itemsize
  for b in (1, 3):
    _, states = steps.init_caches(cfg, m, b, 64, model.decode_params)
    assert all(s["out_proj"].shape == (n, cfg.head_dim, cfg.hidden_size) for s in states)
  assert sharding.state_logical("out_proj", 3) == ("heads", None, None)
  sample = batch_plan.sample_bytes(cfg, m, capacity=64, longest_prompt=48, prefill_chunk=32)
  plain = batch_plan.sample_bytes(cfg, methods.make("snapkv", ratio=0.5), capacity=64,
                                  longest_prompt=48, prefill_chunk=32)
  assert sample.fixed == l * wo_bytes and plain.fixed == 0
  assert sample.kept == plain.kept  # per sample: the same compacted cache, no W^O
  fixed = dict(weights_bytes=0, other_bytes=0, margin_bytes=0)
  assert batch_plan.need(sample, 2, 1, **fixed) - batch_plan.need(plain, 2, 1, **fixed) == (
      l * wo_bytes + sample.transient - plain.transient)
  # prefill-only: gone after end_prefill; a decode phase keeps it
  state = criticalkv.set_out_proj(m.init_state(B, HQ, HKV, D, 32), np.ones((HQ * D, E)))
  assert "out_proj" not in m.compact_state(state, None)
  phased = methods.make("criticalkv", ratio=0.5, max_tokens=24, phase="both")
  assert phased.decode_phase is not None and "out_proj" in phased.compact_state(state, None)
  jax.clear_caches()
