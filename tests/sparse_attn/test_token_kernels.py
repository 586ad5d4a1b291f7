"""Token-level decoders through the Triton decode kernel (Pallas interpret mode): the oracle
top-k, StreamingLLM, Twilight, RocketKV's stage 2 and TidalDecode's reuse layers decode the same
outputs with ``impl="pallas"`` as with their jnp path (``impl="xla"``), with a padding row, and
the kernel really runs (a token list reaches it with one slot an entry)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_attn import methods
from tests.sparse_attn import helpers

CAP, D = 64, 16
SPECS = ["topk", "topk:gqa=group", "streaming", "twilight", "rocketkv"]


def _decode(spec, impl, steps=3, **kw):
  options = dict(budget=0.3, impl=impl, interpret=impl == "pallas", **kw)
  if spec.startswith("rocketkv"):
    options.update(window_size=4, kernel=3)
  m = methods.make(spec, **options)
  outs, _, _ = helpers.prefill_then_decode(m, np.random.default_rng(0), [60, 0], capacity=CAP,
                                           head_dim=D, steps=steps)
  return outs


@pytest.mark.parametrize("spec", SPECS)
def test_token_decoders_match_their_jnp_path(spec, monkeypatch):
  want = _decode(spec, "xla")
  traced = helpers.traced_kernels(monkeypatch)
  got = _decode(spec, "pallas")
  assert ("decode", 1) in traced, traced  # the kernel ran over a token list
  for a, b in zip(got, want):
    a, b = np.asarray(a), np.asarray(b)
    assert np.all(np.isfinite(a)) and not np.any(a[1])  # the padding row is empty
    np.testing.assert_allclose(a, b, **helpers.tol(jnp.float32))


def test_tidal_reuse_layer_matches_its_jnp_path(monkeypatch):
  """A selection layer's relay read by a reuse layer, kernel vs jnp."""
  rng = np.random.default_rng(4)
  b, hq, hkv = 2, 4, 2
  cache = helpers.filled_cache(rng, b, hkv, CAP, D, [50, 17], 16, jnp.float32)
  q = helpers.normal(rng, (b, hq, 1, D))
  k, v = (helpers.normal(rng, (b, hkv, 1, D)) for _ in range(2))
  positions = jnp.asarray([[50], [17]], jnp.int32)
  outs = {}
  traced = helpers.traced_kernels(monkeypatch)
  for impl in ("xla", "pallas"):
    m = methods.make("tidaldecode", budget=12, impl=impl, interpret=impl == "pallas")
    select, reuse = (dataclasses.replace(m, role=r) for r in ("select", "reuse"))
    state = m.init_state(b, hq, hkv, D, CAP)
    _, _, _, relay = select.decode_relay(q, k, v, cache, state, None, positions)
    outs[impl], *_ = reuse.decode_relay(q, k, v, cache, state, relay, positions)
  assert ("decode", 1) in traced, traced
  np.testing.assert_allclose(np.asarray(outs["pallas"]), np.asarray(outs["xla"]),
                             **helpers.tol(jnp.float32))
