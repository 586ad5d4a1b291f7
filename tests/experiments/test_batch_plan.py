"""The memory plan of the GPU accuracy run (``experiments.tasks.batch_plan``): nothing allocated.

Bytes come from ``jax.eval_shape`` of the methods' own layouts, here for Llama-3.1-8B's shape
(bfloat16) at a 32k-token cache on an 80 GiB device: the numbers a GPU run would plan with.
"""

import pytest

from experiments.latency_lib import shapes
from experiments.tasks import batch_plan
from sparse_attn import methods

GIB = 1 << 30
CAPACITY, PROMPT = 33024, 32768  # a 32k prompt + answer room, rounded as the harness does
WEIGHTS = 16 * 10 ** 9


@pytest.fixture(scope="module")
def llama():
  return shapes.model_config("llama-3.1-8b", "bfloat16")


def _sample(config, spec, **kw):
  return batch_plan.sample_bytes(config, methods.make(spec, **kw), capacity=CAPACITY,
                                 longest_prompt=PROMPT, prefill_chunk=2048)


def _plan(sample, device_gib=80, **kw):
  return batch_plan.choose(sample, device_bytes=device_gib * GIB, weights_bytes=WEIGHTS,
                           max_batch=kw.pop("max_batch", 1000), **kw)


def test_dense_cache_bytes_are_the_kv_of_every_layer(llama):
  s = _sample(llama, "dense")
  kv = 2 * 32 * 8 * CAPACITY * 128 * 2  # K and V, 32 layers, 8 kv heads, d 128, bf16
  assert kv <= s.kept <= 1.1 * kv and not s.split  # + slot positions, Quest box digests
  assert s.transient < 0.1 * s.kept


def test_a_larger_budget_fits_a_larger_batch(llama):
  s = _sample(llama, "dense")
  small, large = _plan(s, 40), _plan(s, 80)
  assert 1 <= small.batch < large.batch and large.source == "plan"
  assert large.need_bytes <= 80 * GIB and small.need_bytes <= 40 * GIB
  assert large.batch == 12  # (80 GiB - 16 GB - 9 GiB margin) / ~4.3 GiB per 32k sample
  assert _plan(s, 80, max_batch=5).batch == 5  # never more rows than samples


def test_compression_at_keep_half_fits_a_larger_batch_than_dense(llama):
  dense = _plan(_sample(llama, "dense"))
  for spec in ("snapkv", "expected-attention"):
    s = _sample(llama, spec, ratio=0.5)
    assert s.split and s.kept < 0.55 * _sample(llama, "dense").kept  # the compacted cache
    p = _plan(s)
    assert p.batch > 1.5 * dense.batch, (spec, p.batch, dense.batch)
    assert 1 <= p.prefill_batch <= p.batch and p.need_bytes <= 80 * GIB


def test_the_override_wins(llama):
  s = _sample(llama, "dense")
  p = _plan(s, override=40)
  assert p.batch == 40 and p.prefill_batch == 40 and p.source == "override"
  assert p.need_bytes > 80 * GIB  # the plan says it will not fit; the user asked for it
  c = _plan(_sample(llama, "snapkv", ratio=0.5), override=8, prefill_override=2)
  assert (c.batch, c.prefill_batch) == (8, 2)
  assert batch_plan.choose(s, device_bytes=GIB, weights_bytes=WEIGHTS, max_batch=4,
                           override=1).batch == 1  # an override skips the fit check


def test_a_plan_that_cannot_fit_one_sample_raises_a_clear_error(llama):
  s = _sample(llama, "dense")
  with pytest.raises(batch_plan.DoesNotFit, match=r"not even one sample fits: 4\.\d\d GiB kept"):
    _plan(s, 22)  # 16 GB of weights + 3.2 GiB margin + a 32k cache > 22 GiB
  with pytest.raises(batch_plan.DoesNotFit, match="--config.batch_size=1"):
    _plan(s, 22)
  assert _plan(s, 24).batch == 1


def test_halving_after_an_out_of_memory_error(llama):
  p = _plan(_sample(llama, "snapkv", ratio=0.5))
  h = p.halved()
  assert h.batch == p.batch // 2 and h.prefill_batch <= h.batch and "halved" in h.source
  one = batch_plan.BatchPlan(1, 1, "plan", 0, 0, 0, p.sample).halved()
  assert one.batch == 1


def test_decode_slots_only_for_compression():
  dense = methods.make("dense")
  assert batch_plan.with_decode_slots(dense, 512, 300) is dense
  snap = batch_plan.with_decode_slots(methods.make("snapkv", ratio=0.5), 512, 300)
  assert snap.decode_slots == 212
