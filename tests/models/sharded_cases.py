"""Sharded decoding equals one device, on 8 virtual CPU devices (run in its own process).

``tests/models/test_sharding.py`` runs this file with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the device count is fixed when jax
starts); run alone it skips unless 8 devices exist. One tiny model (16 query heads, 8 kv heads,
so ``model: 8`` splits the heads), one batch of 8 rows (``data: 8`` splits it), a 40-token
prompt and 8 teacher-forced decode steps (rectification twice) per (method, mesh).
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

import models
from models import decode, driver, llama, sharding, steps
from models.config import ModelConfig, RopeConfig
from sparse_attn import context_parallel, methods
from sparse_attn.protocol import PrefillGroup
from tests.sparse_attn import toy_selector  # pylint: disable=unused-import (registers it)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices")

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=16, num_kv_heads=8, head_dim=8, rope=RopeConfig(theta=1000.0),
                  tie_word_embeddings=False, qkv_bias=True)
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 48)).astype(np.int32)
PREFILL, CAPACITY, CHUNK = 40, 64, 16
SEL = dict(block_size=8, n_sink=1, local_window=4)
METHODS = {
    "dense": lambda: methods.make("dense", block_size=8),
    "quest": lambda: methods.make("quest", budget=0.1, **SEL),
    "quest+resa": lambda: methods.make("quest+resa", budget=0.1, **SEL),
    "rectified": lambda: methods.make("quest:gqa=group+rect:f=3", p=0.1, n_min=3, n_local=1,
                                      block_size=8, n_sink=1),
    "quest+retro": lambda: methods.make("quest+retro:w=2", budget=0.1, **SEL),
    "expected_attention": lambda: methods.make("expected_attention", ratio=0.5, block_size=8,
                                               rope_theta=1000.0),
}
MESHES = [(8, 1, 1), (1, 8, 1), (1, 2, 4), (2, 2, 2)]
# Every method on (2, 2, 2), and the splits that change what a shard computes: 4 seq shards
# (context parallel) for RESA and rectification, 8 model shards (one kv head per device) for
# RESA (each pair compiles its own steps, ~7 s of CPU: the process stays short). Quest alone on
# (1, 2, 4) is quest+resa's selection there; a data split keeps rows whole (data:2 on (2, 2, 2)
# splits them as data:8 would, and the experiment loops below run data:2 too).
# SHARDING_FULL_MATRIX=1 runs every method on every mesh (24 pairs).
CASES = ([(name, (2, 2, 2)) for name in METHODS]
         + [(n, (1, 2, 4)) for n in ("quest+resa", "rectified")]
         + [("quest+resa", (1, 8, 1))])
if os.environ.get("SHARDING_FULL_MATRIX") == "1":
  CASES = [(name, shape) for shape in MESHES for name in METHODS]


@pytest.fixture(autouse=True)
def _drop_compiled():
  """Each test compiles its own meshes' steps: drop them after it (fewer live executables and
  memory mappings in this one long process; see tests/conftest.py)."""
  yield
  jax.clear_caches()


@pytest.fixture(scope="module")
def model():
  return models.Model(CFG, llama.init_params(CFG, jax.random.key(0)), None, "tiny")


_REF = {}


def _teacher_forced(model, method, mesh=None):
  return decode.teacher_forced(model, TOKENS, PREFILL, method, prefill_chunk=CHUNK,
                               capacity=CAPACITY, mesh=mesh)


def _reference(model, name):
  if name not in _REF:
    _REF[name] = _teacher_forced(model, METHODS[name]())
  return _REF[name]


def _rel(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_sparse_methods_are_really_sparse(model):
  """The references differ from dense: the equality below is not dense vs dense."""
  dense = _reference(model, "dense")
  for name in ("quest", "rectified", "quest+retro", "expected_attention"):
    assert _rel(_reference(model, name), dense) > 1e-3, name


@pytest.mark.parametrize("name, shape", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_sharded_logits_equal_one_device(model, name, shape):
  mesh = sharding.make_mesh(*shape)
  got = _teacher_forced(model, METHODS[name](), mesh)
  assert _rel(got, _reference(model, name)) <= 1e-5


def _shard_smaller(x) -> bool:
  return all(s.data.size < x.size for s in x.addressable_shards)


@pytest.mark.parametrize("shape", MESHES[1:])  # data:8 alone splits only the batch axis
def test_cache_and_state_leaves_are_sharded(model, shape):
  """After prefill and a decode step, every device holds a slice of the cache and RESA state."""
  mesh = sharding.make_mesh(*shape)
  m, method = sharding.prepare(model, METHODS["quest+resa"](), mesh)
  lengths = np.full((8,), PREFILL, np.int32)
  _, history, caches, states = decode.prefill(m, TOKENS[:, :PREFILL], lengths, method,
                                              method.round_capacity(CAPACITY), CHUNK)
  loop = driver.Decoder(m, method, history, caches, states)
  loop.step(lengths, jax.random.key(0))
  cache, state = loop.caches[0], loop.states[0].resa
  for leaf in (cache.k, cache.v, cache.kmin, cache.pos, state.prior):
    assert _shard_smaller(leaf), (shape, leaf.shape, leaf.sharding)
  sizes = dict(zip(sharding.AXES, shape))  # the memory plan's arithmetic == the real shards
  held = sharding.cache_bytes_per_device(loop.caches)
  assert max(held.values()) == sharding.planned_bytes(loop.caches, sizes)
  seq_split = shape[2] > 1
  assert (cache.k.addressable_shards[0].data.shape[2] < CAPACITY) == seq_split
  assert method.inner == METHODS["quest+resa"]()  # the wrapper keeps the method's identity
  assert dataclasses.is_dataclass(method)


def test_parameters_follow_the_logical_table(model):
  mesh = sharding.make_mesh(1, 8, 1)
  params = sharding.shard(model, mesh).params
  q = params["layers"]["q_proj"]["kernel"]  # [L, E, N*D]: heads over model
  assert q.addressable_shards[0].data.shape == (1, CFG.hidden_size, CFG.q_size // 8)
  down = params["layers"]["down_proj"]["kernel"]  # [L, F, E]: MLP hidden over model
  assert down.addressable_shards[0].data.shape == (1, CFG.intermediate_size // 8, 32)
  emb = params["embed"]  # [V, E]: vocab over model
  assert emb.addressable_shards[0].data.shape == (CFG.vocab_size // 8, CFG.hidden_size)
  norm = params["layers"]["attn_norm"]["scale"]
  assert norm.addressable_shards[0].data.shape == norm.shape  # replicated


def test_experiment_loops_on_a_mesh_equal_one_device(model):
  """The experiments' shared prefills (a dense union with RESA and retro state, a compression
  union of two observers) and their lockstep decoding give one device's numbers on a mesh."""
  from experiments.tasks import decoding  # pylint: disable=g-import-not-at-top
  names = ("dense", "quest+resa", "quest+retro", "expected_attention")
  run_map = {n: METHODS[n]() for n in names}
  run_map["snapkv"] = methods.make("snapkv", ratio=0.5, block_size=8)
  mesh = sharding.make_mesh(2, 2, 2)
  want = decoding.lockstep(model, TOKENS, PREFILL, run_map, prefill_chunk=CHUNK)
  priors = []  # RESA's prior logits after each step: really sharded on the mesh
  hook = lambda label, step, states: priors.append(
      steps.stack_layers(states).resa.prior) if label == "quest+resa" else None
  got = decoding.lockstep(sharding.shard(model, mesh), TOKENS, PREFILL, run_map,
                          prefill_chunk=CHUNK, mesh=mesh, hook=hook)
  assert priors and all(_shard_smaller(p) for p in priors)
  for name in run_map:
    assert _rel(got[name]["nll"], want[name]["nll"]) <= 1e-5, name
    np.testing.assert_array_equal(got[name]["agree"], want[name]["agree"])
  assert _rel(want["snapkv"]["kl"], want["quest+resa"]["kl"]) > 1e-3  # not all the same


def test_greedy_and_query_agnostic_reading_on_a_mesh(model):
  """``prefill_all`` -> ``extend`` (a question read through the decode path after eviction)
  -> ``greedy``, as the accuracy experiment runs them: the same tokens on a mesh."""
  from experiments.tasks import decoding  # pylint: disable=g-import-not-at-top
  run = [METHODS["quest+resa"](), methods.make("snapkv", ratio=0.5, block_size=8)]
  lengths = np.full((8,), 32, np.int32)
  suffix, suffix_lengths = TOKENS[:, 32:36], np.full((8,), 4, np.int32)

  def tokens(mdl, mesh):
    out = []
    for m, pre in decoding.prefill_all(mdl, TOKENS[:, :32], lengths, run, CAPACITY, CHUNK,
                                       mesh=mesh):
      if m.prefill_group == PrefillGroup.COMPRESSION:
        pre = decoding.extend(mdl, pre, m, suffix, suffix_lengths)
      out.append(decoding.greedy(mdl, pre, m, 6, stop_at_eos=False))
    return out

  mesh = sharding.make_mesh(2, 2, 2)
  assert tokens(sharding.shard(model, mesh), mesh) == tokens(model, None)


def test_explicit_axes_mesh_of_jax_make_mesh(model):
  """``jax.make_mesh``'s Explicit axes (JAX's default) are taken as Auto (``auto_mesh``)."""
  explicit = (jax.sharding.AxisType.Explicit,) * 3
  mesh = jax.make_mesh((2, 2, 2), sharding.AXES, axis_types=explicit)
  got = _teacher_forced(model, METHODS["quest"](), mesh)
  assert _rel(got, _reference(model, "quest")) <= 1e-5


def test_a_selector_of_ones_own_decodes_context_parallel_with_its_own_scores(model):
  """The toy selector (tests/sparse_attn/toy_selector.py: one file, one registry line) decodes
  context-parallel on a seq mesh, scoring each shard's local blocks, and equals one device."""
  toy = methods.make("centroid", budget=0.1, **SEL)
  assert context_parallel.supports(toy)
  one = _teacher_forced(model, toy)
  assert _rel(one, _reference(model, "quest")) > 1e-3  # it selects otherwise than Quest
  got = _teacher_forced(model, toy, sharding.make_mesh(1, 2, 4))
  assert _rel(got, one) <= 1e-5
