"""``experiments.tasks.decoding``: the shared prefills equal each method's own prefill, and
reading the question after the prefill (``extend``) equals prefilling it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import modelzoo
from experiments.tasks import compression_union, decoding, prefill_groups
from models import decode
from sparse_attn import methods

SPECS = ["dense", "quest", "quest+resa", "quest+retro:w=2", "quest+resa+retro:w=2",
         "quest+resa:typical_query=last", "quest+retro:w=4", "quest:gqa=group+retro:w=2",
         "quest+rect:f=4", "streaming", "arkvale", "snapkv:ratio=0.5", "snapkv:ratio=0.75",
         "expected_attention:ratio=0.5", "expected_attention:ratio=0.5,n_sink=0",
         "h2o:ratio=0.25", "tova:ratio=0.5", "keydiff:ratio=0.5", "knorm:ratio=0.5",
         "streaming_llm:ratio=0.5", "snapkv:ratio=0.5,head_budget=adakv"]
COMPRESSION = [s for s in SPECS if "ratio" in s]


@pytest.fixture(scope="module")
def model():
  """One tiny random model for the module: its random init costs ~0.2 s a call under the
  suite's compile settings, and nothing here writes to (or donates) its params."""
  return modelzoo.tiny_random()


def test_shared_prefill_equals_own_prefill(model):
  rng = np.random.default_rng(0)
  lengths = np.array([70, 53], np.int32)
  prompts = rng.integers(10, 1000, (2, 70)).astype(np.int32)
  prompts[1, 53:] = 0
  ms = [methods.make(s) if s == "dense" or s in COMPRESSION else methods.make(s, budget=0.25)
        for s in SPECS]
  shared = dict(decoding.prefill_all(model, prompts, lengths, ms, capacity=96))
  assert set(shared) == set(ms)
  keys = dict(zip(SPECS, prefill_groups.prefill_keys(model.config, ms, 96)))
  # Methods without an enhancer state take the compression prefill (their digests computed
  # from its keys: ArkVale's mean box); RESA and retro keep the dense union's.
  assert {s for s, k in keys.items() if k[0] == "compression"} == {
      "dense", "quest", "quest+rect:f=4", "streaming", "arkvale", *COMPRESSION}
  for m in ms:
    got = shared[m]
    want = decode.prefill(model, prompts, lengths, m, m.round_capacity(96), 512)
    assert got.capacity == m.round_capacity(96)
    for g, w in zip((got.last, got.history, got.caches, got.states), want):
      assert jax.tree.structure(g) == jax.tree.structure(w), m.spec
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   atol=1e-5, err_msg=m.spec)
  union = prefill_groups.prefill_union([m for m in ms if isinstance(m, methods.Method)])
  assert union.resa and union.window == 2
  assert union.cache_digests == ("box", "mean_box")  # ArkVale's kept for its copy only
  # typical_query=last and w=4 differ from the union and take their own prefill
  assert not prefill_groups.shares_union(ms[5], union)
  assert not prefill_groups.shares_union(ms[6], union)
  assert prefill_groups.shares_union(ms[4], union)


def test_prefill_order_runs_each_shared_prefill_once(monkeypatch, model):
  """Methods of the dense union and the compression union given in turn: ``prefill_order``
  puts each group's members together (groups by first member, order kept inside a group),
  and ``prefill_all`` in that order prefills each group once, where the order given prefills
  at every change of group."""
  rng = np.random.default_rng(2)
  lengths = np.array([40], np.int32)
  prompts = rng.integers(10, 1000, (1, 40)).astype(np.int32)
  ms = [methods.make("quest+resa", budget=0.25), methods.make("snapkv", ratio=0.5),
        methods.make("arkvale+resa", budget=0.25), methods.make("dense"),
        methods.make("knorm", ratio=0.5), methods.make("quest+resa", budget=0.5),
        methods.make("quest", budget=0.25)]
  order = decoding.prefill_order(model, ms, 64)
  # dense and plain quest join the compression group (their cache is its prefill's)
  assert order == [0, 2, 5, 1, 3, 4, 6]
  calls = []
  real = decode.prefill
  monkeypatch.setattr(decode, "prefill", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
  given = dict(decoding.prefill_all(model, prompts, lengths, ms, capacity=64))
  assert len(calls) == 6  # dense, compression, dense, compression, dense, compression
  calls.clear()
  ordered = dict(decoding.prefill_all(model, prompts, lengths, [ms[i] for i in order], 64))
  assert len(calls) == 2
  for m in ms:
    for a, b in zip(jax.tree.leaves(ordered[m].caches), jax.tree.leaves(given[m].caches)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=m.spec)


def test_compression_union_shares_observations_across_ratios():
  ms = [methods.make(s) for s in COMPRESSION]
  union = compression_union.CompressionUnion.of(ms)
  # snapkv at two ratios and with Ada-KV observe alike; EA's sinks change what it observes
  assert len(union.observers) == len(ms) - 2
  assert union.slot(ms[0]) == union.slot(ms[1]) == union.slot(ms[-1])
  assert union.slot(ms[2]) != union.slot(ms[3])
  with pytest.raises(ValueError, match="not observed"):
    union.slot(methods.make("h2o:ratio=0.5,recent_frac=0.1"))
  both = [methods.make("finch", ratio=0.5), methods.make("finch:rerotate_keys=false", ratio=0.25)]
  assert len(compression_union.CompressionUnion.of(both).observers) == 1  # re-rotation: at the end


def _generate(model, prompts, lengths, m, new, suffix=None, suffix_lengths=None):
  cap = 128
  ((_, pre),) = decoding.prefill_all(model, prompts, lengths, [m], cap)
  if suffix is not None:
    pre = decoding.extend(model, pre, m, suffix, suffix_lengths)
  return decoding.greedy(model, pre, m, new, stop_at_eos=False)


@pytest.mark.parametrize("spec", ["dense", "snapkv:ratio=0.5", "expected_attention:ratio=0.5"])
def test_extend_rows_equal_single_rows(spec, model):
  """Rows with questions of different lengths read side by side give each row's own tokens;
  with dense attention, reading the question after the prefill equals prefilling it."""
  m = methods.make(spec)
  rng = np.random.default_rng(1)
  ctx = [rng.integers(10, 1000, n).astype(np.int32) for n in (60, 45)]
  qs = [rng.integers(10, 1000, n).astype(np.int32) for n in (5, 9)]
  pad = lambda xs: (np.stack([np.pad(x, (0, max(map(len, xs)) - len(x))) for x in xs]),
                    np.array([len(x) for x in xs], np.int32))
  (p, pl), (q, ql) = pad(ctx), pad(qs)
  both = _generate(model, p, pl, m, 6, q, ql)
  for i in range(2):
    alone = _generate(model, ctx[i][None], pl[i:i + 1], m, 6, qs[i][None], ql[i:i + 1])
    assert both[i] == alone[0], spec
    if spec == "dense":
      full = np.concatenate([ctx[i], qs[i]])[None]
      assert both[i] == _generate(model, full, np.array([full.shape[1]], np.int32), m, 6)[0]


@pytest.mark.parametrize("spec", ["expected-attention", "snapkv:ratio=0.5", "dense"])
def test_extend_equals_reading_token_by_token(spec, model):
  """The question read in one chunk (``extend``) gives each row the first answer token, the
  history, the cache and the continuation that reading it one decode step at a time gives
  (``extend_stepwise``; Ada-KV's flat cache, a uniform one, dense)."""
  m = methods.make(spec)
  rng = np.random.default_rng(3)
  lengths = np.array([70, 52], np.int32)
  prompts = rng.integers(10, 1000, (2, 70)).astype(np.int32)
  prompts[1, 52:] = 0
  suffix = rng.integers(10, 1000, (2, 11)).astype(np.int32)
  suffix_lengths = np.array([7, 11], np.int32)
  suffix[0, 7:] = 0
  ((_, pre),) = decoding.prefill_all(model, prompts, lengths, [m], 128)
  fresh = lambda: dataclasses.replace(pre, caches=jax.tree.map(jnp.copy, pre.caches),
                                      states=jax.tree.map(jnp.copy, pre.states))
  got = decoding.extend(model, fresh(), m, suffix, suffix_lengths)
  want = decoding.extend_stepwise(model, fresh(), m, suffix, suffix_lengths)
  np.testing.assert_array_equal(got.first, want.first)
  np.testing.assert_array_equal(got.history, want.history)
  for g, w in zip(jax.tree.leaves(got.caches), jax.tree.leaves(want.caches)):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)
  after = decoding.greedy(model, got, m, 4, stop_at_eos=False)
  assert after == decoding.greedy(model, want, m, 4, stop_at_eos=False)
  np.testing.assert_array_equal(got.lengths, lengths + suffix_lengths)


def test_extend_rejects_rectification_and_full_caches(model):
  m = methods.make("quest+rect:f=4", budget=0.25)
  ((_, pre),) = decoding.prefill_all(model, np.ones((1, 40), np.int32), np.array([40]), [m], 64)
  with pytest.raises(ValueError, match="rectifies"):
    decoding.extend(model, pre, m, np.ones((1, 3), np.int32), np.array([3]))
  d = methods.make("dense")
  ((_, pre),) = decoding.prefill_all(model, np.ones((1, 40), np.int32), np.array([40]), [d], 48)
  with pytest.raises(ValueError, match="no room"):
    decoding.extend(model, pre, d, np.ones((1, 8), np.int32), np.array([8]))


def test_compression_union_refuses_caps_and_windows_it_cannot_model():
  """The shared compression prefill attends uncapped, unwindowed logits: on Gemma or Mistral
  it raises instead of observing the wrong attention."""
  union = compression_union.CompressionUnion.of([methods.make("snapkv", ratio=0.5)])
  with pytest.raises(NotImplementedError, match="uncapped"):
    union.with_softcap(50.0)
  with pytest.raises(NotImplementedError, match="sliding-window"):
    union.with_sliding_window(8)


def test_capped_windowed_model_prefills_each_compression_method_on_its_own(model):
  """On a soft-capped model with local and global layers (Gemma 2's) the shared union is
  skipped: each compression method prefills itself (capped, windowed where the layer is) and
  gets exactly its own prefill."""
  model = dataclasses.replace(model, config=dataclasses.replace(
      model.config, attn_softcap=20.0, sliding_window=24, sliding_layers=(True, False)))
  rng = np.random.default_rng(1)
  lengths = np.array([50], np.int32)
  prompts = rng.integers(10, 1000, (1, 50)).astype(np.int32)
  ms = [methods.make("dense"), methods.make("snapkv", ratio=0.5)]
  got = dict(decoding.prefill_all(model, prompts, lengths, ms, capacity=64))
  for m in ms[1:]:
    want = decode.prefill(model, prompts, lengths, m, m.round_capacity(64), 512)
    for a, b in zip(jax.tree.leaves(got[m].caches), jax.tree.leaves(want[2])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=m.spec)


def _registered():
  """Every registered method but dense, as a run would build it: compression at keep 0.5
  (KVzip in two replay chunks), sparse decoders at a quarter of the cache, presets as set."""
  out = []
  for info in methods.available():
    if info.family == "compression":
      spec = f"{info.name}:chunk_size=32" if info.name == "kvzip" else info.name
      out.append(pytest.param(spec, dict(ratio=0.5), id=info.name))
    elif info.family == "sparse-decode":
      out.append(pytest.param(info.name, dict(budget=0.25), id=info.name))
    elif info.family == "preset":
      out.append(pytest.param(info.name, {}, id=info.name))
  return out


@pytest.mark.parametrize("spec,kwargs", _registered())
def test_every_registered_method_gets_its_own_prefill_from_the_shared_one(spec, kwargs, model):
  """The shared prefills (the compression union: one dense prefill, each member's
  observations, KVzip's replays; the dense union: Quest's and RESA's state) leave each
  registered method the cache and state its own ``models.decode.prefill`` leaves, beside
  methods of both groups."""
  rng = np.random.default_rng(2)
  lengths = np.array([70, 53], np.int32)
  prompts = rng.integers(10, 1000, (2, 70)).astype(np.int32)
  prompts[1, 53:] = 0
  # with the model's RoPE, as a run gives it: FINCH re-rotates its kept keys after the split
  m = decode.with_model_rope(methods.make(spec, **kwargs), model.config)
  ms = [methods.make("dense"), methods.make("snapkv", ratio=0.25),
        methods.make("quest+resa", budget=0.25), m]
  got = dict(decoding.prefill_all(model, prompts, lengths, ms, capacity=96))[m]
  want = decode.prefill(model, prompts, lengths, m, m.round_capacity(96), 512)
  for g, w in zip((got.last, got.history, got.caches, got.states), want):
    assert jax.tree.structure(g) == jax.tree.structure(w), spec
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
      np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                 atol=1e-5, err_msg=spec)


def test_shared_prefill_replays_with_one_chunk_size():
  """KVzip rows share one prefill's replays only at one chunk size (the replay's tokens depend
  on it); the union says so instead of replaying one chunking for both."""
  same = [methods.make("kvzip", ratio=r) for r in (0.25, 0.5)]
  union = compression_union.CompressionUnion.of(same + [methods.make("snapkv", ratio=0.5)])
  assert isinstance(union, compression_union.ReplayingUnion) and union.chunk_size == 2048
  plain = compression_union.CompressionUnion.of([methods.make("snapkv", ratio=0.5)])
  assert not hasattr(plain, "replay")
  with pytest.raises(ValueError, match="one chunk size"):
    compression_union.CompressionUnion.of(same + [methods.make("kvzip:chunk_size=512")])


def test_both_kvzip_selections_share_one_replay():
  """KVzip ranked over all layers and per layer observe alike (one replay, one state slot),
  KVzip+ in a slot of its own (its replay weighs by W^O and the attention-input norms, which
  the shared replay hands it), and each still gets its own prefill's cache from the shared
  one."""
  model = modelzoo.tiny_random(random_norms=True)  # attention-input norms differ by token
  rng = np.random.default_rng(3)
  lengths = np.array([70, 53], np.int32)
  prompts = rng.integers(10, 1000, (2, 70)).astype(np.int32)
  prompts[1, 53:] = 0
  ms = [methods.make("kvzip:chunk_size=32", ratio=0.5),
        methods.make("kvzip:chunk_size=32,layerwise=true", ratio=0.25),
        methods.make("kvzip:chunk_size=32,plus=true", ratio=0.5)]
  assert len(compression_union.CompressionUnion.of(ms).observers) == 2
  got = dict(decoding.prefill_all(model, prompts, lengths, [methods.make("dense")] + ms,
                                  capacity=96))
  for m in ms:
    want = decode.prefill(model, prompts, lengths, m, m.round_capacity(96), 512)
    for a, b in zip(jax.tree.leaves(got[m].caches), jax.tree.leaves(want[2])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=m.spec)


def test_members_of_one_shared_prefill_decode_in_turn_with_little_room(model):
  """Each member of the compression union reads its question and decodes (donating its
  buffers) before the next is split off: no member may hold a buffer of the shared prefill
  (ThinK's slices over a whole axis did). The rows' questions fill almost all of the room
  the cache has after the longest prompt, so ``extend``'s rounded chunk must not outgrow it
  (ThinK's decode keys hold only the rows' room). Each answer equals the method's own."""
  rng = np.random.default_rng(4)
  lengths = np.array([60, 41], np.int32)
  prompts = rng.integers(10, 1000, (2, 60)).astype(np.int32)
  suffix = rng.integers(10, 1000, (2, 9)).astype(np.int32)
  suffix_lengths = np.array([9, 7], np.int32)
  cap, new = 80, 6  # 20 slots after the longest prompt: 9 question tokens + 6 new + 1
  # snapkv+think with SnapKV evicting nothing reads the shared cache's buffers as they are
  ms = [methods.make(s) for s in ("think:ratio=0.5", "observed_attention:ratio=0.5",
                                  "snapkv+think:ratio=0.5", "snapkv:ratio=0.5+think:ratio=0.5",
                                  "knorm:ratio=0.75")]
  got = {}
  for m, pre in decoding.prefill_all(model, prompts, lengths, ms, cap):
    pre = decoding.extend(model, pre, m, suffix, suffix_lengths)
    got[m] = decoding.greedy(model, pre, m, new, stop_at_eos=False)
  for m in ms:
    own = decode.prefill(model, prompts, lengths, m, m.round_capacity(cap), 512)
    pre = decoding.Prefilled(*own, lengths, m.round_capacity(cap))
    pre = decoding.extend(model, pre, m, suffix, suffix_lengths)
    assert got[m] == decoding.greedy(model, pre, m, new, stop_at_eos=False), m.spec


def test_unshared_copies_only_the_shared_leaves():
  a, b, c = jnp.ones(3), jnp.zeros(2), jnp.ones(4)
  out = decoding.unshared({"x": a, "y": c}, [a, b])
  assert out["x"] is not a and np.array_equal(out["x"], a)
  assert out["y"] is c
