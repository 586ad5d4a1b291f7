"""Which implementation runs an op: the Pallas-Triton kernel, the Mosaic GPU kernel, or jnp.

``impl`` (every op's keyword) is one of ``IMPLS``:

* ``"xla"``: the op's jnp ``*_reference`` (the one jnp implementation of it).
* ``"pallas"`` or ``"triton"``: the op's Pallas-Triton kernel. ``"pallas"`` has meant Triton
  since the first kernel here and keeps meaning it, so recorded runs keep their meaning.
* ``"mosaic"``: the op's Mosaic GPU kernel where it has one (``MOSAIC_OPS``); an op without one
  runs its Triton kernel (its reference where Triton is gone), so a whole decode step can be
  asked for Mosaic.
* ``"auto"``: the jnp reference off a GPU; on a GPU, per op and compute capability, the backend
  ``MEASURED_FASTER`` names (a committed GPU record), Triton where nothing was measured, and
  where this JAX has no Triton backend, Mosaic on Hopper and newer (sm_90+, what Mosaic GPU
  targets) and the jnp reference elsewhere.

``resolve_impl`` applies these rules and is the only place that does: it returns ``"pallas"``
(Triton), ``"mosaic"`` or ``"xla"``.

JAX 0.11 deprecated the Pallas Triton backend and warns at every Triton lowering. Where a
Triton kernel here is resolved on a GPU, ``resolve_impl`` silences that repeated warning and
says it once, in one line of its own (``TritonDeprecationNotice``). The plan for the JAX
release without Triton (docs/architecture.md, "Kernel backends"): this package still imports
(the Triton module is looked up, not required), ``"auto"`` picks Mosaic on sm_90+ and the
jnp reference elsewhere, and an explicit ``"pallas"``/``"triton"`` raises saying so.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from typing import Literal, get_args
import warnings

import jax

Impl = Literal["auto", "pallas", "triton", "mosaic", "xla"]
IMPLS: tuple[str, ...] = get_args(Impl)
Resolved = Literal["pallas", "mosaic", "xla"]

# Ops with a Mosaic GPU kernel beside their Triton one (pallas_kernels/mosaic/); the dense
# decode (dense_decode) resolves as sparse_decode, its Mosaic path over the list of every
# block, and block_score_pooled resolves as block_score.
MOSAIC_OPS: frozenset[str] = frozenset({"sparse_decode", "block_score", "cache_append",
                                        "sparse_decode_resa", "sparse_decode_multiquery"})


def list_op(op: str, entry_size: int) -> str:
  """The name ``resolve_impl`` takes for decode op ``op`` over list entries of ``entry_size``
  slots: ``op`` for block lists; ``op + "_tokens"`` for token lists (one slot an entry), which
  no Mosaic kernel serves (its TMA copies move whole blocks of 128 bytes or more) and nothing
  has timed, so they resolve to Triton, or the reference where Triton is gone."""
  return op if entry_size > 1 else f"{op}_tokens"


# Mosaic GPU needs Hopper's TMA and wgmma: sm_90 and newer.
MOSAIC_MIN_CAPABILITY = 9.0

# Per op: (least compute capability, the backend measured faster there, the committed record
# that shows it), first match wins; a row whose backend this JAX lacks is passed over. The
# Mosaic kernels' first GPU timing (H200, sm_90, one Llama-3.1-8B attention layer, bf16,
# batch 1, 8k / 32k / 128k, beside the Triton twins in the same lease) found Triton faster:
# dense (sparse_decode over every block) 4.6x / 5.2x / 6.7x, Quest's step (Mosaic block_score
# + sparse_decode) 2.5x / 2.8x / 3.0x. Ops without a row (cache_append, sparse_decode_resa,
# the multi-query decode: not timed) fall to the rule below, also Triton.
_H200_RUN = "results/gpu_h200/lease/results.jsonl"
MEASURED_FASTER: dict[str, tuple[tuple[float, str, str], ...]] = {
    "sparse_decode": ((9.0, "pallas", _H200_RUN),),
    "block_score": ((9.0, "pallas", _H200_RUN),),
}

_TRITON_MODULE = "jax.experimental.pallas.triton"
_JAX_TRITON_WARNING = "The Pallas Triton backend is deprecated"


class TritonDeprecationNotice(FutureWarning):
  """The one notice that this process runs Pallas-Triton kernels, which JAX deprecated."""


@functools.cache
def triton_available() -> bool:
  """Whether this JAX ships the Pallas Triton backend (``jax.experimental.pallas.triton``)."""
  try:
    importlib.import_module(_TRITON_MODULE)
  except ImportError:
    return False
  return True


@functools.cache
def mosaic_available() -> bool:
  """Whether this JAX ships Pallas Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``)."""
  try:
    importlib.import_module("jax.experimental.pallas.mosaic_gpu")
  except ImportError:
    return False
  return True


class _MissingTriton:
  """Stands for the Triton module where JAX has none: any use raises, saying what to do."""

  def __getattr__(self, name):
    raise RuntimeError(f"this JAX ({jax.__version__}) has no Pallas Triton backend "
                       f"({_TRITON_MODULE}.{name}): use impl='mosaic' (Hopper or newer) or "
                       "impl='xla'")


def triton_module():
  """``jax.experimental.pallas.triton``, or a stand-in raising on use where JAX dropped it."""
  if triton_available():
    return importlib.import_module(_TRITON_MODULE)
  return _MissingTriton()


_ASSUMED_CAPABILITY: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "assumed_capability", default=None)


@contextlib.contextmanager
def assume_capability(capability: float):
  """Inside it, ``device_capability()`` is ``capability``, so ``"auto"`` resolves every op as on
  such a GPU: for lowering what a GPU run traces from a CPU host (``jax.export`` with
  ``platforms=["cuda"]``). Resolution happens at trace time and ``jax.jit`` caches traces, so
  trace functions inside it that are not also traced outside it."""
  token = _ASSUMED_CAPABILITY.set(float(capability))
  try:
    yield
  finally:
    _ASSUMED_CAPABILITY.reset(token)


def device_capability() -> float | None:
  """Compute capability of the default device (e.g. 9.0 for an H100), or the one
  ``assume_capability`` sets; None off CUDA GPUs."""
  assumed = _ASSUMED_CAPABILITY.get()
  if assumed is not None:
    return assumed
  if jax.default_backend() != "gpu":
    return None
  cap = getattr(jax.devices()[0], "compute_capability", None)
  return float(cap) if cap else None


_noticed = False


def _notice_triton():
  """Once per process: silence JAX's per-lowering Triton warning and say it in one line."""
  global _noticed
  if _noticed:
    return
  _noticed = True
  warnings.filterwarnings("ignore", message=_JAX_TRITON_WARNING, category=DeprecationWarning)
  major_minor = tuple(int(p) for p in jax.__version__.split(".")[:2])
  if major_minor >= (0, 11):
    warnings.warn("sparse_attn runs Pallas-Triton kernels, which JAX deprecated in 0.11; "
                  "impl='mosaic' runs the Mosaic GPU kernels (Hopper), see "
                  "docs/architecture.md 'Kernel backends'", TritonDeprecationNotice,
                  stacklevel=3)


def _available(backend: str) -> bool:
  return {"pallas": triton_available, "mosaic": mosaic_available}.get(backend, lambda: True)()


def _auto(op: str | None, capability: float | None) -> Resolved:
  if capability is None:
    return "xla"
  for least, backend, _record in MEASURED_FASTER.get(op, ()):
    if capability >= least and _available(backend):
      return backend
  if triton_available():
    return "pallas"
  if op in MOSAIC_OPS and capability >= MOSAIC_MIN_CAPABILITY and mosaic_available():
    return "mosaic"
  return "xla"


def resolve_impl(impl: Impl, op: str | None = None, *,
                 capability: float | None | Literal["device"] = "device") -> Resolved:
  """The one dispatcher: ``impl`` for ``op`` (a ``pallas_kernels`` op name, e.g.
  ``"sparse_decode"``) -> ``"pallas"`` (its Triton kernel), ``"mosaic"`` or ``"xla"``.

  ``capability``: the device's compute capability (``device_capability()`` by default; None
  for no GPU), given explicitly only to ask what another device would run.

  Raises:
    ValueError: ``impl`` is not one of ``IMPLS``.
    RuntimeError: ``"pallas"``/``"triton"`` where this JAX has no Triton backend.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if capability == "device":
    capability = device_capability()
  if impl == "xla":
    return "xla"
  if impl == "auto":
    resolved = _auto(op, capability)
  elif impl == "mosaic":
    resolved = "mosaic" if op in MOSAIC_OPS else ("pallas" if triton_available() else "xla")
  else:
    if not triton_available():
      raise RuntimeError(f"impl={impl!r} runs the Pallas-Triton kernel, and this JAX "
                         f"({jax.__version__}) has no Triton backend: use impl='mosaic' "
                         "(Hopper or newer), 'auto' or 'xla'")
    resolved = "pallas"
  if resolved == "pallas" and capability is not None:
    _notice_triton()
  return resolved
