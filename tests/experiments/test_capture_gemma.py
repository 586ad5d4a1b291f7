"""``capture`` on a model with local (windowed) and global layers and a soft-cap (Gemma 2):
each layer attends as the model does, ``Captured.logits`` applies the window and the cap, and
without ``windows_and_softcap=True`` such a model is refused."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.common import capture
from models import llama
from models.config import ModelConfig

S, WINDOW = 14, 4
CONFIG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, hidden_act="gelu_pytorch_tanh", norm_plus_one=True,
    sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=8.0, attn_softcap=0.5,
    sliding_window=WINDOW, sliding_layers=(True, False), model_type="gemma2")


@pytest.fixture(scope="module")
def model():
  params = llama.init_params(CONFIG, jax.random.key(0))
  params = jax.tree.map(lambda a: a * 4 if a.ndim > 1 else a, params)  # logits the cap bends
  return types.SimpleNamespace(config=CONFIG, params=params)


def _reference(model, tokens):
  """q/k/v and attention outputs per layer from ``llama.forward``'s own attention."""
  positions = jnp.arange(S, dtype=jnp.int32)[None]
  base = llama.causal_attend(CONFIG, positions)

  def attend(q, k, v, inp):
    out, _ = base(q, k, v, inp)
    return out, {**inp, "q": q, "k": k, "v": v, "out": out}

  n, kv, d = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
  zeros = lambda *shape: jnp.zeros((CONFIG.num_layers, 1, *shape), jnp.float32)
  per_layer = {"local": jnp.asarray(CONFIG.sliding_layers), "q": zeros(n, S, d),
               "k": zeros(kv, S, d), "v": zeros(kv, S, d), "out": zeros(n, S, d)}
  x = llama.embed(model.params, CONFIG, jnp.asarray(tokens)[None])
  _, got = llama.run_layers(model.params, CONFIG, x, positions, attend, per_layer)
  return {k: np.asarray(a)[:, 0] for k, a in got.items() if k != "local"}


def test_refused_without_the_flag(model):
  with pytest.raises(ValueError, match="windows_and_softcap"):
    capture.capture(model, np.arange(S) % 64, chunk=4)


def test_layers_attend_as_the_model(model):
  tokens = np.random.default_rng(0).integers(0, 64, S)
  cap = capture.capture(model, tokens, chunk=4, windows_and_softcap=True)
  assert cap.windows == (WINDOW, None) and cap.softcap == 0.5
  ref = _reference(model, tokens)
  assert ref["out"].shape == (2, 4, S, 8), ref["out"].shape
  for name in "qkv":
    np.testing.assert_allclose(getattr(cap, name), ref[name], atol=2e-5, rtol=1e-5)
  for layer in range(2):
    w = jax.nn.softmax(cap.logits(layer), axis=-1)  # [N, S, S]
    out = np.einsum("nst,ntd->nsd", w, np.repeat(cap.v[layer], cap.group, axis=0))
    np.testing.assert_allclose(out, ref["out"][layer], atol=2e-5, rtol=1e-5)
  plain = capture.Captured(cap.q, cap.k, cap.v, cap.tokens, cap.scale)  # no window, no cap
  assert not np.allclose(jax.nn.softmax(plain.logits(0), -1), jax.nn.softmax(cap.logits(0), -1),
                         atol=1e-3)
