"""Sharding over a device mesh with axes ``data`` (batch), ``model`` (heads, MLP) and ``seq``.

One logical-axis table says what each dimension of every parameter, cache and method-state leaf
*is* (``batch``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``, ``seq``, or None); ``RULES`` maps
logical axes to mesh axes. A dimension is sharded only when its mesh axis has more than one
device and divides it; otherwise it is replicated (e.g. 3 kv heads on ``model: 2``), so every
mesh runs every model and still gives one device's numbers.

  mesh = sharding.make_mesh(data=2, model=2, seq=2)
  model = sharding.shard(model, mesh)                       # tensor-parallel parameters
  # jax.make_mesh((2, 2, 2), ("data", "model", "seq")) works too: axes made Auto (auto_mesh)
  models.generate(model, prompt, 32, method, mesh=mesh)      # sharded caches and states

Inside the decode loop a method is wrapped in :class:`ShardedMethod`: every per-layer function
constrains the cache and state it returns to the table's shardings (GSPMD partitions the rest),
and when ``seq > 1`` and the method is supported, decode runs context-parallel under
``jax.shard_map`` (``sparse_attn.context_parallel``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from sparse_attn import context_parallel
from sparse_attn.protocol import AttentionMethod

AXES = ("data", "model", "seq")
# logical axis -> mesh axis
RULES = {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model",
         "vocab": "model", "seq": "seq"}

# Parameters (one layer; the stacked ``[L]`` axis and per-layer lists are handled by the walk).
PARAM_AXES = {
    "embed": ("vocab", None),
    "lm_head": (None, "vocab"),
    ("q_proj", "kernel"): (None, "heads"), ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): (None, "kv_heads"), ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): (None, "kv_heads"), ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", None), ("o_proj", "bias"): (None,),
    ("gate_proj", "kernel"): (None, "mlp"), ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "kernel"): (None, "mlp"), ("up_proj", "bias"): ("mlp",),
    ("down_proj", "kernel"): ("mlp", None), ("down_proj", "bias"): (None,),
}

# Cache and method-state leaves of one layer, by (name, rank). Names not listed shard their
# leading (batch) axis only: every state leaf leads with the batch axis, except the per-layer
# leaves listed without "batch" (CriticalKV's W^O).
_BKTD = ("batch", "kv_heads", "seq", None)
STATE_AXES = {
    # KVCache (sparse_attn.cache): slots and blocks over seq
    ("k", 4): _BKTD, ("v", 4): _BKTD, ("kmin", 4): _BKTD, ("kmax", 4): _BKTD,
    ("kcen", 4): _BKTD, ("kdev", 4): _BKTD, ("pos", 3): ("batch", "kv_heads", "seq"),
    ("krad", 3): ("batch", "kv_heads", "seq"), ("kcos", 3): ("batch", "kv_heads", "seq"),
    # RESA (enhancers.resa)
    ("prior", 3): ("batch", "heads", "seq"), ("qsum", 3): ("batch", "heads", None),
    ("qlast", 3): ("batch", "heads", None), ("mu_q", 3): ("batch", "heads", None),
    ("osum", 3): ("batch", "heads", None), ("pmax", 2): ("batch", "heads"),
    ("zsum", 2): ("batch", "heads"), ("ksum", 3): ("batch", "kv_heads", None),
    ("kcount", 2): ("batch", "kv_heads"), ("head_log_lam", 2): ("batch", "heads"),
    ("head_beta", 2): ("batch", "heads"),
    # RetroAttention (enhancers.retro): ring [B, N, W, ...], entries seen [B, H, E]
    ("out", 4): ("batch", "heads", None, None), ("pout", 4): ("batch", "heads", None, None),
    ("lse", 3): ("batch", "heads", None), ("plse", 3): ("batch", "heads", None),
    ("exposed", 3): ("batch", "heads", None), ("seen", 3): ("batch", "heads", None),
    ("last_seen", 3): ("batch", "heads", "seq"), ("retired_exposed", 2): ("batch", "heads"),
    # compression: H2O accumulated attention [B, K, T], query rings [B, W, N, D], Expected
    # Attention's query moments [B, N, D] and [B, N, D, D]
    ("acc", 3): ("batch", "kv_heads", "seq"), ("buf", 4): ("batch", None, "heads", None),
    ("mean", 3): ("batch", "heads", None), ("m2", 4): ("batch", "heads", None, None),
    # CriticalKV's W^O [N, D, E]: one per layer, no batch axis (compression.criticalkv)
    ("out_proj", 3): ("heads", None, None),
    # KVzip+'s W^O as stored, [N D, E] (head-major rows; compression.kvzip)
    ("out_proj", 2): ("heads", None),
    # ThinK's kept key channels [B, K, D'] beside its pruned KVCache parts (compression.think)
    ("channels", 3): ("batch", "kv_heads", None),
}


def make_mesh(data: int = 1, model: int = 1, seq: int = 1, devices=None) -> Mesh:
  """A ``(data, model, seq)`` mesh over ``devices`` (default: the first ``data*model*seq``).

  Axes are ``AxisType.Auto`` (GSPMD propagates shardings between the annotated arrays).
  """
  shape = (data, model, seq)
  if any(not isinstance(s, int) or s < 1 for s in shape):
    raise ValueError(f"mesh axis sizes must be ints >= 1, got data={data} model={model} seq={seq}")
  devices = jax.devices() if devices is None else list(devices)
  need = math.prod(shape)
  if need > len(devices):
    raise ValueError(f"mesh data={data} model={model} seq={seq} needs {need} devices, "
                     f"{len(devices)} available")
  grid = np.asarray(devices[:need], dtype=object).reshape(shape)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def auto_mesh(mesh: Mesh) -> Mesh:
  """``mesh`` with ``AxisType.Auto`` axes (the same devices and names), or a one-line refusal.

  The tables here place arrays by NamedSharding and let GSPMD propagate the rest, which needs
  Auto axes; ``jax.make_mesh`` builds Explicit ones by default, so any mesh whose axes are
  exactly ``data``, ``model`` and ``seq`` (in any order) is taken with its axis types made Auto.
  """
  if not isinstance(mesh, Mesh) or sorted(mesh.axis_names) != sorted(AXES):
    names = getattr(mesh, "axis_names", type(mesh).__name__)
    raise ValueError(f"a mesh needs the axes {AXES}, got {names}: build one with "
                     "models.make_mesh(data=, model=, seq=)")
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(AXES))


def parse_mesh(text: str) -> dict[str, int]:
  """``"data:2,model:2,seq:2"`` -> ``{"data": 2, "model": 2, "seq": 2}`` (missing axes = 1)."""
  sizes = dict.fromkeys(AXES, 1)
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, size = part.partition(":")
    if name not in AXES or not size.strip().isdigit() or int(size) < 1:
      raise ValueError(f"bad mesh entry {part!r} in {text!r}: want NAME:SIZE with NAME in "
                       f"{AXES} and SIZE >= 1, e.g. 'data:2,model:2,seq:2'")
    sizes[name] = int(size)
  return sizes


def mesh_from_text(text: str | None) -> Mesh | None:
  """``make_mesh`` from a ``--mesh`` flag value; None or empty -> None (one device)."""
  return make_mesh(**parse_mesh(text)) if text else None


def spec_for(logical, shape, mesh) -> P:
  """The PartitionSpec of ``logical`` axes for an array of ``shape`` on ``mesh``.

  A dimension gets its mesh axis only when that axis has more than one device, divides the
  dimension, and is not already used by an earlier dimension. ``mesh``: a Mesh, or a dict of
  axis sizes (for plans of meshes that are not here).
  """
  sizes = mesh if isinstance(mesh, dict) else mesh.shape
  out, used = [], set()
  for name, size in zip(logical, shape):
    axis = RULES.get(name) if name else None
    n = sizes.get(axis, 1) if axis else 1
    if axis is None or axis in used or n == 1 or size % n:
      out.append(None)
    else:
      out.append(axis)
      used.add(axis)
  while out and out[-1] is None:  # P('data', None) == P('data') for jit's cache keys too
    out.pop()
  return P(*out)


def _key_name(entry) -> str | None:
  for attr in ("key", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return None


def _names(path) -> tuple[str, ...]:
  return tuple(n for n in map(_key_name, path) if n is not None)


def _param_logical(path, ndim: int):
  names = _names(path)
  entry = PARAM_AXES.get(names[-2:]) or PARAM_AXES.get(names[-1:][0] if names else None)
  if entry is None:
    return (None,) * ndim
  return (None,) * (ndim - len(entry)) + tuple(entry)  # leading [L] of stacked layers


def param_shardings(params, mesh: Mesh):
  """NamedShardings of a parameter pytree (stacked ``[L]`` or per-layer lists alike)."""
  def one(path, x):
    return NamedSharding(mesh, spec_for(_param_logical(path, x.ndim), x.shape, mesh))
  return jax.tree_util.tree_map_with_path(one, params)


def shard(model, mesh: Mesh):
  """``model`` with its parameters placed on ``mesh`` by ``PARAM_AXES`` (tensor parallel).

  ``mesh``: any mesh with axes ``data``, ``model``, ``seq`` (``auto_mesh``)."""
  mesh = auto_mesh(mesh)
  params = jax.device_put(model.params, param_shardings(model.params, mesh))
  return dataclasses.replace(model, params=params)


def state_logical(name: str | None, ndim: int):
  """Logical axes of a cache/state leaf called ``name`` (one layer's: no ``[L]`` axis)."""
  entry = STATE_AXES.get((name, ndim), ("batch",) + (None,) * (ndim - 1) if ndim else ())
  return tuple(entry)


def state_shardings(tree, mesh: Mesh):
  """NamedShardings for a cache/state pytree (batch over ``data``, heads over ``model``,
  slots and blocks over ``seq``)."""
  def one(path, x):
    names = _names(path)
    logical = state_logical(names[-1] if names else None, x.ndim)
    return NamedSharding(mesh, spec_for(logical, x.shape, mesh))
  return jax.tree_util.tree_map_with_path(one, tree)


def constrain(tree, mesh: Mesh):
  """``with_sharding_constraint`` of every leaf to ``state_shardings`` (inside jit)."""
  return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh))


def place(tree, mesh: Mesh):
  """``device_put`` of every leaf to ``state_shardings`` (eager)."""
  return jax.device_put(tree, state_shardings(tree, mesh))


@dataclasses.dataclass(frozen=True)
class ShardedMethod:
  """A method whose caches and states live sharded on ``mesh`` (hashable: a jit static arg).

  Every attribute not defined here is the wrapped method's (schedule flags, spec, budgets).
  ``decode`` runs context-parallel (``sparse_attn.context_parallel``) when ``seq > 1`` and the
  method is supported there; everything else runs under GSPMD on the sharded arrays.
  """

  inner: AttentionMethod
  mesh: Mesh

  def __getattr__(self, name):
    if name in ("inner", "mesh"):  # not yet set (copy / unpickle): no recursion
      raise AttributeError(name)
    return getattr(self.inner, name)

  def _cp_specs(self, cache, state):
    """``(cache_spec, state_spec)`` when this layer decodes context-parallel, else None."""
    if self.mesh.shape["seq"] == 1 or not context_parallel.supports(self.inner):
      return None
    specs = state_specs((cache, state), self.mesh)
    return specs if context_parallel.usable(self.inner, specs[0], self.mesh) else None

  def for_layer(self, layer: int, num_layers: int | None = None) -> "ShardedMethod":
    """The wrapped method's method for decoder layer ``layer``, sharded like this one."""
    for_layer = getattr(self.inner, "for_layer", None)
    return self if for_layer is None else dataclasses.replace(
        self, inner=for_layer(layer, num_layers))

  def with_sliding_window(self, window: int) -> "ShardedMethod":
    return dataclasses.replace(self, inner=self.inner.with_sliding_window(window))

  def with_softcap(self, softcap: float) -> "ShardedMethod":
    return dataclasses.replace(self, inner=self.inner.with_softcap(softcap))

  def with_rope(self, inv_freq) -> "ShardedMethod":
    give = getattr(self.inner, "with_rope", None)  # a custom method may model no RoPE
    return self if give is None else dataclasses.replace(self, inner=give(inv_freq))

  def round_capacity(self, n: int) -> int:
    """The inner rounding, then a multiple of ``seq * block_size`` (whole blocks per shard)."""
    cap = self.inner.round_capacity(n)
    unit = self.mesh.shape["seq"] * self.inner.block_size
    return -(-cap // unit) * unit

  def init_caches(self, num_layers: int, init):
    """``num_layers`` separate ``init() -> (cache, state)`` results, created sharded."""
    make = jax.jit(init, out_shardings=state_shardings(jax.eval_shape(init), self.mesh))
    return [make() for _ in range(num_layers)]

  def place_rows(self, x):
    """``x [B, ...]`` (e.g. the token history) with its rows over ``data``."""
    return jax.device_put(x, NamedSharding(self.mesh, spec_for(("batch",), x.shape, self.mesh)))

  def _constrained(self, out, cache, state):
    cache, state = constrain((cache, state), self.mesh)
    return out, cache, state

  def prefill(self, q, k, v, cache, state, positions, *, scale=None):
    return self._constrained(*self.inner.prefill(q, k, v, cache, state, positions, scale=scale))

  def extend(self, q, k, v, cache, state, positions, *, scale=None):
    return self._constrained(*self.inner.extend(q, k, v, cache, state, positions, scale=scale))

  def rectify(self, q, k, v, cache, state, positions, *, scale=None):
    return self._constrained(*self.inner.rectify(q, k, v, cache, state, positions, scale=scale))

  def decode(self, q, k, v, cache, state, positions, *, scale=None):
    specs = self._cp_specs(cache, state)
    if specs is not None:
      return context_parallel.decode(self.inner, q, k, v, cache, state, positions, scale,
                                     mesh=self.mesh, specs=specs)
    return self._constrained(*self.inner.decode(q, k, v, cache, state, positions, scale=scale))

  def end_prefill(self, cache, state, *, scale=None):
    """Eager (compression sizes its buffer from concrete lengths); the result is re-placed."""
    specs = self._cp_specs(cache, state)
    if specs is not None:
      cache, state = context_parallel.end_prefill(self.inner, cache, state, scale,
                                                  mesh=self.mesh, specs=specs)
    else:
      cache, state = self.inner.end_prefill(cache, state, scale=scale)
    return place((cache, state), self.mesh)


def state_specs(tree, mesh: Mesh):
  """The PartitionSpecs of ``state_shardings`` (for ``shard_map``'s in/out specs)."""
  return jax.tree.map(lambda s: s.spec, state_shardings(tree, mesh))


def wrap(method: AttentionMethod, mesh: Mesh | None) -> AttentionMethod:
  """``method`` as a ``ShardedMethod`` on ``mesh`` (unchanged for ``mesh=None`` or when it is
  already wrapped)."""
  if mesh is None or isinstance(method, ShardedMethod):
    return method
  return ShardedMethod(method, auto_mesh(mesh))


def prepare(model, method: AttentionMethod, mesh: Mesh | None):
  """``(model, method)`` for a run on ``mesh``: parameters placed, method wrapped (no-op for
  ``mesh=None``). Idempotent: an already wrapped method or placed model is kept."""
  if mesh is None:
    return model, method
  mesh = auto_mesh(mesh)
  return shard(model, mesh), wrap(method, mesh)


def _split(spec, sizes) -> int:
  return math.prod(sizes[a] for a in spec if a is not None)


def planned_bytes(tree, sizes: dict, kind: str = "state") -> int:
  """Bytes per device of ``tree`` (arrays or ``jax.ShapeDtypeStruct``) laid out by the tables
  on a mesh of axis ``sizes`` (``{"data": 2, ...}``); ``kind``: ``"state"`` or ``"param"``."""
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = _names(path)
    if kind == "param":
      logical = _param_logical(path, len(x.shape))
    else:
      logical = state_logical(names[-1] if names else None, len(x.shape))
    spec = spec_for(logical, x.shape, sizes)
    total += math.prod(x.shape) * np.dtype(x.dtype).itemsize // _split(spec, sizes)
  return total


def cache_bytes_per_device(tree) -> dict:
  """Bytes of a pytree of (sharded) arrays held by each device: ``{device id: bytes}``."""
  out: dict[int, int] = {}
  for x in jax.tree.leaves(tree):
    for s in x.addressable_shards:
      out[s.device.id] = out.get(s.device.id, 0) + s.data.size * s.data.dtype.itemsize
  return out


__all__ = ["AXES", "RULES", "PARAM_AXES", "STATE_AXES", "make_mesh", "auto_mesh", "parse_mesh",
           "mesh_from_text", "spec_for", "param_shardings", "shard", "state_shardings",
           "constrain", "place", "ShardedMethod", "wrap", "prepare",
           "cache_bytes_per_device"]
