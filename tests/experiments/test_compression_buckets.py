"""Bucketed compacted caches (``CompressionMethod.capacity_bits``, ``compact.bucket``): the sizes
it picks; the same layer outputs as exact sizes (to float rounding: the softmax sums a longer
buffer of masked slots) and the same answers;
no more distinct cache shapes over layers; PyramidKV's layers decode with one method
(``models.steps.per_layer``); the harness applies the config's bits without renaming a row."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from experiments.common import modelzoo
from experiments.tasks import decoding
from models import steps
from sparse_attn import methods
from sparse_attn.compression import compact
from tests.sparse_attn import helpers


@hypothesis.settings(deadline=None, max_examples=200, derandomize=True)
@hypothesis.given(n=st.integers(1, 1 << 20), bits=st.integers(0, 6),
                  block=st.sampled_from([1, 4, 16, 64]))
def test_bucket_holds_n_in_a_block_multiple_at_most_a_share_larger(n, bits, block):
  got = compact.bucket(n, bits, block)
  exact = compact.round_up(n, block)
  assert got >= exact and got % block == 0
  assert got <= max(exact * (1 + 2.0 ** -bits), exact + block)  # at most 2^-bits more
  assert compact.bucket(got, bits, block) == got  # a bucket is its own bucket
  assert compact.bucket(n, 30, block) == exact  # enough bits: exact


def test_bucket_has_two_to_the_bits_sizes_per_doubling():
  for bits in (0, 1, 2, 3):
    sizes = {compact.bucket(n, bits, 16) for n in range(1025, 2049)}
    assert len(sizes) == 2 ** bits and max(sizes) == 2048, (bits, sorted(sizes))


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5", "snapkv:ratio=0.5,head_budget=adakv",
                                  "pyramidkv:ratio=0.5", "kvzip:ratio=0.5",
                                  "rocketkv:budget=0.3"])
def test_a_bucketed_cache_gives_the_same_layer_outputs(spec):
  """Prefill, compaction and decode steps on a ragged batch: each output equal to float
  rounding (bit for bit on some CPUs; XLA's CPU reductions may tile a longer buffer of masked
  slots differently, seen on an AMD EPYC host: ~1e-7)."""
  outs = {}
  for bits in (None, 0):
    m = methods.make(spec, block_size=4).with_capacity_bits(bits)
    outs[bits], prompt_cache, _ = helpers.prefill_then_decode(
        m, np.random.default_rng(0), [37, 21], capacity=64, head_dim=8, steps=5)
    if bits == 0:
      assert prompt_cache.capacity > exact_capacity, spec  # the test compares two sizes
    else:
      exact_capacity = prompt_cache.capacity
  for a, b in zip(outs[None], outs[0], strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                               err_msg=spec)


@pytest.mark.parametrize("spec", ["pyramidkv:ratio=0.5", "kvzip:ratio=0.5",
                                  "snapkv:ratio=0.75,head_budget=adakv"])
def test_a_bucketed_run_gives_the_same_answers(spec):
  """The model's greedy answers after a query-agnostic question, ragged rows: the same with
  the compacted caches bucketed."""
  model = modelzoo.tiny_random()
  rng = np.random.default_rng(3)
  prompts = rng.integers(10, 1000, (2, 90)).astype(np.int32)
  lengths = np.array([90, 61], np.int32)
  question = rng.integers(10, 1000, (2, 7)).astype(np.int32)
  q_lengths = np.array([7, 4], np.int32)
  answers, capacities = {}, {}
  for bits in (None, 0):
    m = methods.make(spec).with_capacity_bits(bits)
    ((_, pre),) = decoding.prefill_all(model, prompts, lengths, [m], 256)
    capacities[bits] = [c.capacity for c in pre.caches]
    pre = decoding.extend(model, pre, m, question, q_lengths)
    answers[bits] = decoding.greedy(model, pre, m, 8, stop_at_eos=False)
  assert answers[None] == answers[0], spec
  assert all(b >= a for a, b in zip(capacities[None], capacities[0]))
  assert any(b > a for a, b in zip(capacities[None], capacities[0]))  # two sizes compared
  assert len(set(capacities[0])) <= len(set(capacities[None]))
  if spec.startswith("kvzip"):  # its layers keep different counts: two shapes become one
    assert len(set(capacities[None])) == 2 and len(set(capacities[0])) == 1


def test_bucketing_leaves_the_prompt_cache_and_the_shared_prefill_alone():
  """Only the compacted cache is bucketed: the prompt's cache keeps the caller's capacity, so
  dense still joins the compression methods' shared prefill at any capacity."""
  from experiments.tasks import prefill_groups  # pylint: disable=import-outside-toplevel
  cfg = modelzoo.tiny_random().config
  ms = [methods.make("dense"), methods.make("snapkv:ratio=0.5").with_capacity_bits(2),
        methods.make("pyramidkv:ratio=0.5").with_capacity_bits(0)]
  for capacity in (4352, 4096, 1000):
    assert [m.round_capacity(capacity) for m in ms[1:]] == [-(-capacity // 16) * 16] * 2
    keys = prefill_groups.prefill_keys(cfg, ms, capacity)
    assert len(set(keys)) == 1 and keys[0][0] == "compression", (capacity, keys)
  assert ms[1].compacted_capacity(4352) == 5120 and ms[2].compacted_capacity(4352) == 8192


def test_pyramid_layers_decode_with_one_method():
  """PyramidKV's layers differ only in the prompt's cut: after it, one method (one compiled
  step per cache shape) serves every layer; TidalDecode's layers still differ."""
  m = methods.make("pyramidkv:ratio=0.5")
  n = 8
  assert len({steps.per_layer(m, i, n, "prefill") for i in range(n)}) == n
  assert {steps.per_layer(m, i, n, phase) for i in range(n) for phase in ("decode", "extend")} \
      == {m}
  assert len({steps.per_layer(m, i, n) for i in range(n)}) == n  # end_prefill's call
  decoding_budget = methods.make("pyramidkv:ratio=0.5,phase=both")
  assert not decoding_budget.layer_free_decode
  assert len({steps.per_layer(decoding_budget, i, n, "decode") for i in range(n)}) == n
  tidal = methods.make("tidaldecode", budget=0.1)
  assert len({steps.per_layer(tidal, i, 32, "decode") for i in range(32)}) > 1


def test_capacity_bits_is_validated():
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="capacity_bits"):
      methods.make("snapkv:ratio=0.5").with_capacity_bits(bad)
