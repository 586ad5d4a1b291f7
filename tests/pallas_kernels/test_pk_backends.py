"""pallas_kernels.backends: the one dispatcher, the Triton deprecation notice, and a JAX without
the Pallas Triton backend (simulated in a child interpreter)."""

from __future__ import annotations

import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backends
from sparse_attn import methods
import no_triton
from tests import isolated


def test_resolve_impl_explicit_and_auto_here():
  assert backends.resolve_impl("xla") == "xla"
  assert backends.resolve_impl("pallas") == backends.resolve_impl("triton") == "pallas"
  want = "pallas" if jax.default_backend() == "gpu" else "xla"
  assert backends.resolve_impl("auto", "sparse_decode") == want
  assert backends.IMPLS == typing.get_args(backends.Impl)
  assert backends.IMPLS == ("auto", "pallas", "triton", "mosaic", "xla")
  with pytest.raises(ValueError, match=r"impl must be one of .*'mosaic'"):
    backends.resolve_impl("cuda")


def test_auto_per_device_and_measured_table(monkeypatch):
  resolve = backends.resolve_impl
  monkeypatch.setattr(backends, "_noticed", True)  # no notice from these simulated GPUs
  assert resolve("auto", "sparse_decode", capability=None) == "xla"
  # Triton wherever JAX has it, Hopper included (measured faster there: MEASURED_FASTER).
  for cap in (8.0, 8.9, 9.0):
    assert resolve("auto", "sparse_decode", capability=cap) == "pallas"
  # A measured row whose backend this JAX lacks is passed over (Triton gone: Mosaic).
  monkeypatch.setattr(backends, "triton_available", lambda: False)
  assert resolve("auto", "sparse_decode", capability=9.0) == (
      "mosaic" if backends.mosaic_available() else "xla")
  monkeypatch.setattr(backends, "triton_available", lambda: True)
  monkeypatch.setattr(backends, "MOSAIC_OPS", frozenset({"sparse_decode"}))
  monkeypatch.setattr(backends, "MEASURED_FASTER",
                      {"sparse_decode": ((9.0, "mosaic", "results/x.jsonl"),)})
  assert resolve("auto", "sparse_decode", capability=9.0) == "mosaic"
  assert resolve("auto", "sparse_decode", capability=8.0) == "pallas"  # below the row
  assert resolve("auto", "block_score", capability=9.0) == "pallas"  # not measured
  # Explicit Mosaic: the op's Mosaic kernel, else its Triton one.
  assert resolve("mosaic", "sparse_decode", capability=9.0) == "mosaic"
  assert resolve("mosaic", "block_select", capability=9.0) == "pallas"


def test_token_lists_never_resolve_to_mosaic(monkeypatch):
  """One slot an entry: no Mosaic kernel (TMA moves whole blocks), so Triton, else the jnp path."""
  resolve, op = backends.resolve_impl, backends.list_op("sparse_decode", 1)
  monkeypatch.setattr(backends, "_noticed", True)
  assert backends.list_op("sparse_decode", 16) == "sparse_decode"
  for impl in ("auto", "mosaic"):
    assert resolve(impl, op, capability=9.0) == "pallas"
  monkeypatch.setattr(backends, "triton_available", lambda: False)
  assert resolve("auto", op, capability=9.0) == resolve("mosaic", op, capability=9.0) == "xla"
  assert resolve("auto", "sparse_decode", capability=9.0) == (
      "mosaic" if backends.mosaic_available() else "xla")


def test_assume_capability_is_scoped(monkeypatch):
  """Inside ``assume_capability``, ``auto`` resolves as on that GPU; outside, as here."""
  monkeypatch.setattr(backends, "_noticed", True)
  here = backends.device_capability()
  with backends.assume_capability(9.0):
    assert backends.device_capability() == 9.0
    assert backends.resolve_impl("auto", "sparse_decode") == "pallas"
    with backends.assume_capability(8.0):
      assert backends.device_capability() == 8.0
    assert backends.device_capability() == 9.0
  assert backends.device_capability() == here
  with pytest.raises(RuntimeError), backends.assume_capability(9.0):
    raise RuntimeError("left by an exception")
  assert backends.device_capability() == here


def test_triton_notice_is_one_line_and_silences_jax(monkeypatch):
  monkeypatch.setattr(backends, "_noticed", False)
  monkeypatch.setattr(jax, "__version__", "0.11.2")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
      assert backends.resolve_impl("auto", "sparse_decode", capability=9.0) == "pallas"
    # JAX 0.11's own warning, raised at each Triton lowering, is silenced from now on.
    for _ in range(3):
      warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future "
                    "JAX version.", DeprecationWarning)
  notices = [w for w in caught if issubclass(w.category, backends.TritonDeprecationNotice)]
  assert len(notices) == 1 and "\n" not in str(notices[0].message)
  assert not [w for w in caught if w.category is DeprecationWarning]


def test_no_notice_off_gpu_or_before_the_deprecation(monkeypatch):
  monkeypatch.setattr(backends, "_noticed", False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backends.resolve_impl("pallas", "sparse_decode", capability=None)  # interpret on a CPU
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    backends.resolve_impl("auto", "sparse_decode", capability=9.0)
  assert not [w for w in caught if issubclass(w.category, backends.TritonDeprecationNotice)]


def test_package_imports_and_decodes_without_triton():
  got, finite, mosaic_ops = isolated.run(no_triton.decode_without_triton, timeout=300)
  assert finite == [True, True]
  assert got[8.0] == "xla"  # no Mosaic before Hopper: the jnp reference
  assert got[9.0] == ("mosaic" if "sparse_decode" in mosaic_ops else "xla")


def _quest_decode(impl, interpret):
  rng = np.random.default_rng(1)
  b, hq, hkv, d, s, t = 1, 4, 2, 32, 100, 128
  mk = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  m = methods.make("quest", budget=0.5, impl=impl, interpret=interpret)
  cache = m.init_cache(b, hkv, t, d)
  state = m.init_state(b, hq, hkv, d, t)
  _, cache, state = m.prefill(mk(b, hq, s, d), mk(b, hkv, s, d), mk(b, hkv, s, d), cache, state,
                              jnp.arange(s)[None])
  cache, state = m.end_prefill(cache, state)
  out, _, _ = m.decode(mk(b, hq, 1, d), mk(b, hkv, 1, d), mk(b, hkv, 1, d), cache, state,
                       jnp.full((b, 1), s))
  return out


def test_mosaic_impl_runs_the_mosaic_kernels_in_a_decode_step(monkeypatch):
  """impl="mosaic" on a method: block scores, the sparse decode and the cache append run their
  Mosaic GPU kernels (GPU interpret mode here), the other ops their Triton ones; the step
  equals the jnp one."""
  from pallas_kernels import mosaic  # pylint: disable=import-outside-toplevel
  calls = []
  for name in ("sparse_decode", "block_score", "cache_append"):
    real = getattr(mosaic, name)
    monkeypatch.setattr(mosaic, name, lambda *a, _real=real, _name=name, **kw: (
        calls.append(_name), _real(*a, **kw))[1])
  got = _quest_decode("mosaic", True)
  assert sorted(set(calls)) == ["block_score", "cache_append", "sparse_decode"]
  np.testing.assert_allclose(got, _quest_decode("xla", False), atol=2e-5, rtol=2e-5)


def test_measured_table_cites_records_that_show_it():
  """Every MEASURED_FASTER row names a committed record file in which, at that capability's
  device, the named backend's step is faster than the other Pallas backend's in one run."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  # which per-layer rows time an op on each backend: (Triton row, Mosaic row)
  rows = {"sparse_decode": ("dense", "dense:impl=mosaic"),
          "block_score": ("quest:gqa=group", "quest:gqa=group,impl=mosaic")}
  assert backends.MEASURED_FASTER
  for op, entries in backends.MEASURED_FASTER.items():
    assert op in backends.MOSAIC_OPS
    for _least, backend, record in entries:
      recs = [json.loads(line) for line in open(os.path.join(root, record))]
      triton, mosaic = rows[op]
      for ctx in (8192, 32768, 131072):
        got = {r["method"]: r for r in recs if r.get("section") == "per_layer"
               and r.get("context") == ctx and r["method"] in (triton, mosaic)}
        assert set(got) == {triton, mosaic} and got[mosaic]["git_verified"], (op, ctx)
        faster = "pallas" if got[triton]["ms"] < got[mosaic]["ms"] else "mosaic"
        assert faster == backend, (op, ctx, got[triton]["ms"], got[mosaic]["ms"])
