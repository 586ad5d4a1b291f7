"""Per-layer decode attention at Llama-3.1-8B's shape (Hq 32, Hkv 8, D 128, batch 1), plus the
dense step's peers: PyTorch SDPA and JAX's own ``jax.nn.dot_product_attention`` (cuDNN's fused
kernel on a GPU when it takes the shape, else XLA's), the candidates for our dense decode.

One pre-filled cache per (dtype, context) is threaded through every method's jitted ``decode``
with the cache and state donated (``donate_argnums``), so the new token's K/V write is in place
(XLA:CPU honours donation; the write costs ~0.2 ms at 32k instead of a 270 MB copy). All methods
write the same K/V at the same slots, so sharing the cache changes no timing. The cache keeps the
block digests the measured methods read (``cache_kinds``: the box alone for Quest, dense and
ReSA), as each method's own cache would; a step updates every kept kind of the touched block.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.latency_lib import timing, traffic
from sparse_attn import kernels, methods
from sparse_attn import cache as cache_lib
from sparse_attn.cache import write
from sparse_attn.spec import parse_spec

STATE_CHUNK = 16  # prompt queries that form RESA's prior (a short last chunk keeps 128k cheap)


def make_method(spec: str, s, p: float | None = None):
  """``methods.make`` with the config's p, block size and impl (inline options win)."""
  inline = {k for _, opts in parse_spec(spec) for k in opts}
  kw = dict(block_size=s.block_size, impl=s.impl, interpret=s.interpret)
  if parse_spec(spec)[0][0] != "dense" and "budget" not in inline:  # a budget replaces p
    kw["p"] = s.p if p is None else p
  return methods.make(spec, **{k: v for k, v in kw.items() if k not in inline})


def peak_gbs(s) -> float:
  """The config's peak bandwidth, else the GPU's data-sheet figure (0 on a CPU: no bound)."""
  if jax.default_backend() != "gpu" and not s.peak_bandwidth_gbs:
    return 0.0
  return traffic.peak_gbs_for(jax.devices()[0].device_kind, s.peak_bandwidth_gbs)[0]


def _stepper(apply, steps: int = 1):
  """Jitted ``apply(q, k, v, cache, state, pos) -> (out, cache, state)``, cache and state donated.

  With ``steps > 1`` the call runs ``steps`` steps in a device loop (the outputs summed, so no
  step is dead code): on a GPU one dispatch then covers many microsecond steps.
  """
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(cache, state, q, k, v, pos):
    out, cache, state = apply(q, k, v, cache, state, pos)
    if steps == 1:
      return out, cache, state

    def body(_, carry):
      acc, cache, state = carry
      o, cache, state = apply(q, k, v, cache, state, pos)
      return acc + o, cache, state
    return jax.lax.fori_loop(1, steps, body, (out, cache, state))
  return step


def prefill_fn(m):
  """Jitted ``prefill`` + ``end_prefill`` of one chunk -> ``(out, cache, state)``.

  The chunk's attention output is returned so that XLA cannot drop the attention itself.
  """
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(cache, state, q, k, v, pos):
    out, cache, state = m.prefill(q, k, v, cache, state, pos)
    cache, state = m.end_prefill(cache, state)
    return out, cache, state
  return step


class Bench:
  """The shared cache and inputs of one (dtype, context)."""

  def __init__(self, s, dtype, context: int, max_new: int, seed: int,
               digests=cache_lib.DIGEST_KINDS):
    self.s, self.dtype, self.context = s, jnp.dtype(dtype), context
    hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
    bs = s.block_size
    self.capacity = -(-(context + max_new) // bs) * bs
    keys = jax.random.split(jax.random.key(seed), 6)
    k = jax.random.normal(keys[0], (1, hkv, context, d), self.dtype)
    v = jax.random.normal(keys[1], (1, hkv, context, d), self.dtype)
    # One cache every candidate steps in turn: it keeps every digest kind they read.
    cache = cache_lib.init_cache(1, hkv, self.capacity, d, bs, self.dtype, digests)
    pos = jnp.arange(context, dtype=jnp.int32)[None]
    self.cache = jax.jit(write, donate_argnums=(0,))(cache, k, v, pos)
    self.kv_numpy = (np.asarray(k.astype(jnp.float32)), np.asarray(v.astype(jnp.float32)))
    del k, v
    self.q = jax.random.normal(keys[2], (1, hq, max_new, d), self.dtype)
    self.k_new = jax.random.normal(keys[3], (1, hkv, max_new, d), self.dtype)
    self.v_new = jax.random.normal(keys[4], (1, hkv, max_new, d), self.dtype)
    self.q_chunk = jax.random.normal(keys[5], (1, hq, STATE_CHUNK, d), self.dtype)

  def window(self, n: int):
    """Positions ``[1, n]`` ending at the decode slot ``context``, and their q/k/v."""
    pos = jnp.arange(self.context - n + 1, self.context + 1, dtype=jnp.int32)[None]
    return self.q[:, :, :n], self.k_new[:, :, :n], self.v_new[:, :, :n], pos

  def state_factory(self, m):
    """A jitted zero-argument ``m.init_state`` (one dispatch: on a GPU the eager zeros of a
    state are a dozen transfers that would dwarf a prefill chunk)."""
    s = self.s
    return jax.jit(functools.partial(m.init_state, 1, s.num_heads, s.num_kv_heads, s.head_dim,
                                     self.capacity, self.dtype))

  def last_chunk(self, m, name: str, chunk: int, seed: int) -> timing.Candidate:
    """The last ``chunk`` prompt tokens through ``m``'s ``prefill`` + ``end_prefill`` (RESA's
    prior is formed there) on a fresh state, rewriting the cache's own K/V (unchanged)."""
    s = self.s
    q = jax.random.normal(jax.random.key(seed), (1, s.num_heads, chunk, s.head_dim), self.dtype)
    lo = self.context - chunk
    pos = jnp.arange(lo, self.context, dtype=jnp.int32)[None]
    kc, vc = self.cache.k[:, :, lo:self.context], self.cache.v[:, :, lo:self.context]
    fn, init = prefill_fn(m), self.state_factory(m)

    def step():
      out, self.cache, st = fn(self.cache, init(), q, kc, vc, pos)
      return out, st
    return timing.Candidate(name, step)

  def state_for(self, m):
    """``m``'s state after a short last prompt chunk and ``end_prefill`` (RESA's prior)."""
    st = m.init_state(1, self.s.num_heads, self.s.num_kv_heads, self.s.head_dim, self.capacity,
                      self.dtype)
    if not m.enhanced:
      return st
    lo = self.context - STATE_CHUNK
    pos = jnp.arange(lo, self.context, dtype=jnp.int32)[None]
    kc = self.cache.k[:, :, lo:self.context]
    vc = self.cache.v[:, :, lo:self.context]  # rewrite the same K/V: the cache is unchanged
    _, self.cache, st = prefill_fn(m)(self.cache, st, self.q_chunk, kc, vc, pos)
    return st

  def selected_tokens(self, m) -> float:
    if m.is_dense:
      return float(self.context)
    sel = jax.jit(m.select)(self.q[:, :, 0], self.cache)
    return float(np.mean(np.asarray(sel.n_valid))) * sel.granularity

  def candidates(self, m, name):
    """Timed decode step of ``m`` (and its rectify pass when it rectifies)."""
    st = {"state": self.state_for(m)}
    q, k, v, pos = self.window(m.window)
    steps = self.s.steps_per_call
    step = _stepper(m.decode, steps)

    def dec():
      out, self.cache, st["state"] = step(self.cache, st["state"], q, k, v, pos)
      return out
    out = [timing.Candidate(name, dec, per_call=steps)]
    if m.rect_interval:
      rq, rk, rv, rpos = self.window(m.rect_interval)
      rect = _stepper(m.rectify, steps)

      def rec():
        o, self.cache, st["state"] = rect(self.cache, st["state"], rq, rk, rv, rpos)
        return o
      out.append(timing.Candidate(name + " [rectify pass]", rec, per_call=steps))
    return out

  def attend_only(self, m, name):
    """``m.attend`` of the newest query without the cache write, ``steps_per_call`` in a device
    loop (each step's output is the next query, so no step is loop-invariant)."""
    steps = self.s.steps_per_call
    pos = jnp.array([self.context - 1], jnp.int32)

    @jax.jit
    def att(q, cache):
      one = lambda _, q: m.attend(q, cache, pos)[0].astype(q.dtype)
      return jax.lax.fori_loop(0, steps, one, q)
    q = self.q[:, :, 0]
    return timing.Candidate(name, lambda: att(q, self.cache), per_call=steps)

  def torch_sdpa(self, threads: int):
    """PyTorch ``scaled_dot_product_attention`` (GQA) over the same K/V, same threads; on a GPU
    on the same device, ``steps_per_call`` calls per timed call and one synchronisation (as
    ours loops its steps on the device)."""
    import torch  # pylint: disable=g-import-not-at-top
    import torch.nn.functional as F  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(threads)
    cuda = jax.default_backend() == "gpu" and torch.cuda.is_available()
    dev, steps = ("cuda", self.s.steps_per_call) if cuda else ("cpu", 1)
    tdt = torch.bfloat16 if self.dtype == jnp.bfloat16 else torch.float32
    k, v = (torch.from_numpy(x).to(dev, tdt) for x in self.kv_numpy)
    q = torch.from_numpy(np.asarray(self.q[:, :, :1].astype(jnp.float32))).to(dev, tdt)

    def fn():
      with torch.inference_mode():
        for _ in range(steps):
          out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        if cuda:
          torch.cuda.synchronize()
          return None
        return out.float().numpy()
    return timing.Candidate("torch SDPA (dense)", fn, per_call=steps)

  def jax_sdpa(self):
    """``jax.nn.dot_product_attention`` of the newest query over the same K/V (GQA), cuDNN on a
    GPU when it compiles for the shape, else XLA's; ``steps_per_call`` steps per call on the
    device (a loop whose outputs are summed, so no step is dead code)."""
    steps = self.s.steps_per_call
    # [1, T, K, D] / [1, 1, N, D]: the function's layout, transposed once outside the timing
    k, v = (jnp.asarray(x, self.dtype).transpose(0, 2, 1, 3) for x in self.kv_numpy)
    q = self.q[:, :, :1].transpose(0, 2, 1, 3)

    def compiled(impl):
      def call(q, k, v):
        one = lambda: jax.nn.dot_product_attention(q, k, v, implementation=impl)
        return jax.lax.fori_loop(1, steps, lambda _, acc: acc + one(), one())
      return jax.jit(call).lower(q, k, v).compile()

    impl = "cudnn" if jax.default_backend() == "gpu" else None
    try:
      fn = compiled(impl)
    except Exception:  # pylint: disable=broad-except (cuDNN refuses some shapes / versions)
      impl, fn = None, compiled(None)
    return timing.Candidate(f"jax dot_product_attention ({impl or 'xla'})",
                            lambda: fn(q, k, v), per_call=steps)


def cache_kinds(ms) -> tuple[str, ...]:
  """The digest kinds the methods ``ms`` (``Method``s) keep, in ``DIGEST_KINDS`` order."""
  kept = {k for m in ms for k in m.cache_digests}
  return tuple(k for k in cache_lib.DIGEST_KINDS if k in kept)


def run_context(s, dtype: str, context: int, specs: list[str], torch_peer: bool) -> list[dict]:
  """Times every method at one (dtype, context); returns one record per timed row."""
  ms = [(spec, make_method(spec, s)) for spec in specs]
  max_new = max([8] + [m.window for _, m in ms] + [m.rect_interval for _, m in ms])
  b = Bench(s, dtype, context, max_new, s.seed, cache_kinds([m for _, m in ms]))
  itemsize = b.dtype.itemsize
  cands, meta = [], {}
  for spec, m in ms:
    meta[spec] = (m, b.selected_tokens(m))
    cands += b.candidates(m, spec)
    if m.is_dense:
      cands.append(b.attend_only(m, "dense (attend only)"))
  if torch_peer:
    cands += [b.torch_sdpa(s.threads), b.jax_sdpa()]
  b.kv_numpy = None
  timing.interleaved(cands, s.warmup, s.repeats, s.max_seconds_per_context)
  by_name = {c.name: c for c in cands}
  dense_s = by_name["dense"].median_s if "dense" in by_name else float("nan")
  dbytes = traffic.dense_bytes(context, s.num_kv_heads, s.head_dim, itemsize)
  peak = peak_gbs(s)
  rows = []
  for c in cands:
    if c.name.endswith("[rectify pass]"):
      continue
    sec, rec = c.median_s, {}
    if c.name in meta:
      m, sel = meta[c.name]
      frac = traffic.fraction(m, context=context, selected_tokens=sel,
                              num_q_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                              head_dim=s.head_dim, itemsize=itemsize)
      rec.update(selected_tokens=sel, p_eff=sel / context, window=m.window,
                 impl=m.impl if m.is_dense else kernels.resolve_impl(m.impl),
                 rect_interval=m.rect_interval)
      if m.rect_interval:
        rect_s = by_name[c.name + " [rectify pass]"].median_s
        rec.update(decode_ms=sec * 1e3, rectify_ms=rect_s * 1e3)
        sec = sec + rect_s / m.rect_interval  # amortised per step
    else:
      frac = 1.0  # dense attend-only and the torch peer read everything
    gbs = dbytes * frac / sec / 1e9
    rec.update(section="per_layer", dtype=dtype, context=context, method=c.name,
               ms=sec * 1e3, times_ms=[t * 1e3 for t in c.times], first_call_s=c.first_s,
               speedup=dense_s / sec, traffic_fraction=frac, bound=1.0 / frac, gbs=gbs,
               pct_peak=100.0 * gbs / peak if peak else None, threads=s.threads,
               cpu_count=os.cpu_count(), device=jax.devices()[0].device_kind,
               steps_per_call=c.per_call)
    rows.append(rec)
  return rows
