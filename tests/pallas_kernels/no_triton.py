"""A JAX without the Pallas Triton backend, simulated in a child interpreter (imports nothing
at module level but ``sys``, so the block is in place before JAX's Pallas modules load)."""

import sys


class _NoTriton:
  """A meta-path finder refusing the Pallas Triton modules, as a JAX without them would."""

  def find_spec(self, name, path=None, target=None):
    del path, target
    if name in ("jax.experimental.pallas.triton", "jax._src.pallas.triton") or name.startswith(
        "jax._src.pallas.triton."):
      raise ImportError(f"simulated: no {name}")
    return None


def decode_without_triton():
  """In a fresh interpreter: blocks Triton, imports the package, resolves and decodes ->
  ``(auto's choice per capability, outputs finite per method, MOSAIC_OPS)``."""
  sys.meta_path.insert(0, _NoTriton())
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import pallas_kernels  # pylint: disable=import-outside-toplevel,unused-import
  from pallas_kernels import backends as be  # pylint: disable=import-outside-toplevel
  from sparse_attn import methods  # pylint: disable=import-outside-toplevel

  assert "jax.experimental.pallas.triton" not in sys.modules
  assert not be.triton_available()
  got = {cap: be.resolve_impl("auto", "sparse_decode", capability=cap) for cap in (8.0, 9.0)}
  for impl in ("pallas", "triton"):
    try:
      be.resolve_impl(impl, "sparse_decode")
    except RuntimeError as e:
      assert "no Triton backend" in str(e), e
    else:
      raise AssertionError(f"impl={impl!r} resolved without Triton")
  try:
    sys.modules["pallas_kernels.block_select"].plgpu.load  # pylint: disable=pointless-statement
  except RuntimeError as e:
    assert "impl='mosaic'" in str(e), e
  else:
    raise AssertionError("the Triton stand-in did not raise")
  rng = np.random.default_rng(0)
  b, hq, hkv, d, s, t = 1, 4, 2, 16, 40, 64
  mk = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  outs = []
  for spec in ("dense", "quest"):
    m = methods.make(spec, budget=0.5) if spec != "dense" else methods.make("dense")
    cache = m.init_cache(b, hkv, t, d)
    state = m.init_state(b, hq, hkv, d, t)
    _, cache, state = m.prefill(mk(b, hq, s, d), mk(b, hkv, s, d), mk(b, hkv, s, d), cache,
                                state, jnp.arange(s)[None])
    cache, state = m.end_prefill(cache, state)
    out, _, _ = m.decode(mk(b, hq, 1, d), mk(b, hkv, 1, d), mk(b, hkv, 1, d), cache, state,
                         jnp.full((b, 1), s))
    outs.append(bool(jnp.all(jnp.isfinite(out))))
  return got, outs, sorted(be.MOSAIC_OPS)
