"""The decode loop: dense teacher forcing == full forward, padding, methods, schedule hooks.

Every call uses the same capacity and chunk size so the compiled steps are shared.
"""

import dataclasses

import jax
import numpy as np
import pytest

import models
from models import decode, driver, llama
from models.config import ModelConfig, RopeConfig
from sparse_attn import methods

CFG = ModelConfig(vocab_size=61, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=1000.0),
                  tie_word_embeddings=False, qkv_bias=True)
KW = dict(prefill_chunk=16, capacity=64, stop_at_eos=False)
DENSE = methods.make("dense", block_size=8)


@pytest.fixture(scope="module")
def model():
  return models.Model(CFG, llama.init_params(CFG, jax.random.key(0)), None, "tiny")


def _tokens(b, n, seed=0):
  return np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, n)).astype(np.int32)


PROMPT = _tokens(1, 40)[0].tolist()


@pytest.fixture(scope="module")
def dense_tokens(model):
  return decode.generate(model, PROMPT, 8, DENSE, **KW).tokens


def test_dense_teacher_forced_equals_forward(model):
  tokens = _tokens(2, 48)
  full = np.asarray(model.forward(tokens))
  # chunk 16 -> two prompt chunks, the second one partly padding
  tf = decode.teacher_forced(model, tokens, 21, DENSE, prefill_chunk=16, capacity=64)
  assert tf.shape == (2, 48 - 21 + 1, CFG.vocab_size)
  np.testing.assert_allclose(tf, full[:, 20:], rtol=1e-4, atol=1e-4)


def test_greedy_generation_matches_forward_argmax(model, dense_tokens):
  seq = np.array([PROMPT + dense_tokens[0]])
  logits = np.asarray(model.forward(seq))[0, len(PROMPT) - 1:-1]
  assert dense_tokens[0] == logits.argmax(-1).tolist()


def test_batch_with_padding_equals_batch_one(model, dense_tokens):
  prompts = [_tokens(1, n, seed=n)[0].tolist() for n in (5, 19)] + [PROMPT]
  batched = decode.generate(model, prompts, 8, DENSE, **KW)
  assert batched.tokens[2] == dense_tokens[0]
  for i, p in enumerate(prompts[:2]):
    assert batched.tokens[i] == decode.generate(model, p, 8, DENSE, **KW).tokens[0]


@pytest.mark.parametrize("spec, kw, exact", [
    ("quest", dict(budget=0.25), False),
    ("quest", dict(budget=1.0), True),  # a budget covering everything is dense
    ("quest+retro", dict(budget=1.0, w=3), True),  # window > 1 decode steps
    ("quest+rect", dict(budget=0.25, f=3), False),
    ("snapkv", dict(ratio=0.5), False),  # compacted (smaller) cache after the prompt
    ("h2o", dict(ratio=0.5, head_budget="adakv"), False),  # per-layer cache sizes
])
def test_methods_run_end_to_end(model, dense_tokens, spec, kw, exact):
  method = methods.make(spec, block_size=8, **kw)
  gen = decode.generate(model, PROMPT, 8, method, **KW)
  assert len(gen.tokens[0]) == 8
  if exact:
    assert gen.tokens == dense_tokens


@dataclasses.dataclass(frozen=True)
class _Rectifying(methods.Method):
  """Dense attention that also asks for a dense rectification every 3 tokens."""

  @property
  def rect_interval(self) -> int:
    return 3


def test_rectification_hook_keeps_dense_tokens(model, dense_tokens):
  rect = _Rectifying(block_size=8)
  assert decode.generate(model, PROMPT, 8, rect, **KW).tokens == dense_tokens
  tokens = _tokens(1, 48)
  tf = decode.teacher_forced(model, tokens, 21, rect, prefill_chunk=16, capacity=64)
  np.testing.assert_allclose(tf, np.asarray(model.forward(tokens))[:, 20:], rtol=1e-4,
                             atol=1e-4)


def test_sampling_seeded_and_top_p(model, dense_tokens):
  s = models.Sampling(temperature=1.0, top_p=0.9, seed=3)
  a = decode.generate(model, PROMPT, 8, DENSE, s, **KW)
  b = decode.generate(model, PROMPT, 8, DENSE, s, **KW)
  assert a.tokens == b.tokens
  logits = np.log(np.array([[0.1, 0.5, 0.2, 0.15, 0.05]]))  # tiny top_p -> argmax
  for seed in range(5):
    tok = models.sampling.sample(logits, jax.random.key(seed), models.Sampling(1.0, 1e-6))
    assert int(tok[0]) == 1


def test_stop_at_eos(model, dense_tokens):
  eos = dense_tokens[0][2]
  m2 = models.Model(CFG.replace(eos_token_ids=(eos,)), model.params, None)
  cut = decode.generate(m2, PROMPT, 8, DENSE, **{**KW, "stop_at_eos": True})
  assert cut.tokens[0] == dense_tokens[0][:dense_tokens[0].index(eos) + 1]


def test_window_positions():
  np.testing.assert_array_equal(driver.window_positions(np.array([1, 5]), 3),
                                [[-1, 0, 1], [3, 4, 5]])


def test_decode_layout_model_holds_one_copy_and_decodes_the_same(model, dense_tokens):
  one = model.in_decode_layout()
  assert isinstance(one.params["layers"], list) and one.decode_params is one.params
  assert len(jax.tree.leaves(one.params)) == len(jax.tree.leaves(model.decode_params))
  assert decode.generate(one, PROMPT, 8, DENSE, **KW).tokens == dense_tokens
  tokens = _tokens(2, 24)
  np.testing.assert_allclose(np.asarray(one.forward(tokens)), np.asarray(model.forward(tokens)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["dense", "quest+resa", "quest+rect:f=4", "quest+retro:w=2"])
def test_one_program_step_equals_the_per_layer_step(model, spec, monkeypatch):
  """The GPU path (embedding, every layer and sampling in one jit) gives the per-layer path's
  tokens and logits; it is what ``fused_by_default`` picks on a GPU."""
  m = methods.make(spec, block_size=8, **({} if spec == "dense" else dict(budget=16)))
  tokens = _tokens(1, 48, seed=3)
  ref = decode.teacher_forced(model, tokens, 32, m, prefill_chunk=16)
  per_layer = decode.generate(model, PROMPT, 8, m, **KW).tokens
  monkeypatch.setattr(models.steps, "fused_by_default", lambda: True)
  np.testing.assert_allclose(decode.teacher_forced(model, tokens, 32, m, prefill_chunk=16), ref,
                             rtol=1e-5, atol=1e-5)
  assert decode.generate(model, PROMPT, 8, m, **KW).tokens == per_layer


def test_tokens_are_read_back_in_batches_and_stop_at_eos(model, dense_tokens):
  kw = {**KW, "capacity": 128}
  long = decode.generate(model, PROMPT, 3 * decode.READBACK, DENSE, **kw)
  eos = long.tokens[0][decode.READBACK + 2]  # first emitted after the first read-back
  first = long.tokens[0].index(eos)
  m2 = models.Model(CFG.replace(eos_token_ids=(eos,)), model.params, None)
  cut = decode.generate(m2, PROMPT, 3 * decode.READBACK, DENSE, **{**kw, "stop_at_eos": True})
  assert cut.tokens[0] == long.tokens[0][:first + 1]
  assert cut.decode_steps < 3 * decode.READBACK - 1  # stopped at the next read-back


@pytest.mark.parametrize("spec,options", [("quest+resa", {"budget": 32}), ("dense", {})])
def test_one_program_step_lowers_for_cuda_with_the_pallas_kernels(model, spec, options):
  """The GPU decode step on the Pallas kernels (Quest + RESA; dense: split-K flash decoding)
  exports for CUDA as one program (only the Triton custom call's compatibility check is
  disabled)."""
  from models import steps  # pylint: disable=g-import-not-at-top
  from tests.pallas_kernels.test_pk_lowering import TRITON_CALL, export_cuda
  m = methods.make(spec, block_size=16, impl="pallas", **options)
  caches, states = steps.init_caches(CFG, m, 1, 128)
  spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)

  def step(params, history, positions, caches, states):
    return steps._decode_program(params, history, positions, caches, states, jax.random.key(0),
                                 config=CFG, method=m, sampling=models.Sampling())

  hist = jax.ShapeDtypeStruct((1, 128), np.int32)
  pos = jax.ShapeDtypeStruct((1, 1), np.int32)
  text = export_cuda(step, spec(model.decode_params), hist, pos, spec(caches), spec(states))
  assert TRITON_CALL in text and text.count("func.func public @main") == 1


def test_fused_projections_decode_and_forward_the_same(model, dense_tokens, monkeypatch):
  """The GPU decode layout (q/k/v and gate/up each one matrix, ``llama.fuse_projections``)
  gives the separate projections' tokens and logits, through ``forward`` and the one-program
  decode step; fusing twice changes nothing."""
  fused = llama.decode_layout(model.params, fuse=True)
  layer = fused["layers"][0]
  assert set(layer) >= {"qkv_proj", "gate_up_proj"} and "q_proj" not in layer
  assert layer["qkv_proj"]["kernel"].shape == (CFG.hidden_size, CFG.q_size + 2 * CFG.kv_size)
  assert layer["qkv_proj"]["bias"].shape == (CFG.q_size + 2 * CFG.kv_size,)  # qkv_bias=True
  assert llama.fuse_projections(layer) is layer and not llama.fuse_by_default(model.params)
  one = models.Model(CFG, fused, None, "tiny")
  tokens = _tokens(2, 24)
  np.testing.assert_allclose(np.asarray(one.forward(tokens)), np.asarray(model.forward(tokens)),
                             rtol=1e-5, atol=1e-5)
  m = methods.make("quest+resa", block_size=8, budget=16)
  forced = _tokens(1, 48, seed=3)
  ref = decode.teacher_forced(model, forced, 32, m, prefill_chunk=16)
  monkeypatch.setattr(models.steps, "fused_by_default", lambda: True)
  np.testing.assert_allclose(decode.teacher_forced(one, forced, 32, m, prefill_chunk=16), ref,
                             rtol=1e-5, atol=1e-5)
  assert decode.generate(one, PROMPT, 8, DENSE, **KW).tokens == dense_tokens


def test_one_program_step_copies_no_donated_leaf():
  """The GPU step returns its donated buffers first: no cache or state leaf is copied to make
  room for another output of the same shape (the sampled token once shifted every [B] int32
  leaf onto its neighbour's buffer, a device copy each per step)."""
  from models import steps  # pylint: disable=g-import-not-at-top
  m = methods.make("quest+resa", block_size=8, budget=16)
  params = llama.decode_layout(llama.init_params(CFG, jax.random.key(0)), fuse=False)
  caches, states = steps.init_caches(CFG, m, 1, 64)
  hist, pos = np.zeros((1, 64), np.int32), np.zeros((1, 1), np.int32)
  text = steps._decode_program.lower(params, hist, pos, caches, states, jax.random.key(0),
                                     config=CFG, method=m,
                                     sampling=models.Sampling()).compile().as_text()
  assert " s32[1]{0} copy(" not in text
