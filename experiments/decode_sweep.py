r"""Launch-configuration sweeps of the decode kernels: the dense split-K decode next to torch
SDPA and cuDNN, the Mosaic GPU decode's step bodies, and the block select's bits per pass next
to ``lax.top_k``.

  python -m experiments.decode_sweep --contexts=32768,131072 --out=/tmp/decode_sweep.jsonl
  python -m experiments.decode_sweep --contexts=8192,32768,131072 --iters= --mosaic=mma,rows
  python -m experiments.decode_sweep --contexts= --select_entries=2048,8192
  python -m experiments.decode_sweep --contexts=131072 --sparse_keep=0.1 --splits=0,2,4

One Llama-3.1-8B attention layer (32 q / 8 kv heads, d = 128, batch 1, ``--dtype`` cache), the
dense decode attention ``kernels.dense_decode`` (``pallas_kernels.dense_decode``, the split-K
kernel over every block in its identity mode, slot positions loaded) under each
``(num_splits, blocks_per_iter, num_stages, num_warps)`` of the grid. Each timed call loops
``--steps`` steps on the device, the output of one step being the next step's query (so no
step is loop-invariant), and the median of
``--repeats`` calls is reported per step. Each configuration prints its line as it finishes
(a run cut short keeps what it measured); ``x sdpa`` is torch SDPA's time over the row's, both
measured in this run on the same device. ``num_splits=None`` is ``choose_num_splits``'s count,
``blocks_per_iter=None`` the shared-memory fit for the stages; ``dense_decode`` runs
``num_splits=None, blocks_per_iter=None, num_stages=2`` (``DENSE_DECODE_STAGES``).

``--sparse_keep`` also times the Triton ``pallas_kernels.sparse_decode`` over a Quest-sized
group list (that fraction of the blocks, fixed, in id order; section ``sparse_decode``) under
the same grid, the split count scaled from the list's length: Quest's 128k step gives each of
its 264 programs ~7 iterations, so its prologue and the iteration's dependent chain, not the
bandwidth, may set the pace (each row has its fraction of peak, ``--peak_tbs``).

``--mosaic`` times ``pallas_kernels.mosaic.sparse_decode`` on the same layer (section
``mosaic_decode``): dense without a list (``dense_decode``'s identity mode), dense as the list of
every block, and a Quest-sized list (``--mosaic_keep`` of the
blocks, a fixed random set in id order, shared by the group), per step body (``mma``: the
WGMMA products; ``rows``: CUDA-core rows), tokens a step (``--mosaic_tokens``) and ring depth
(``--mosaic_stages``), each row with its fraction of the peak bandwidth the bytes it must read
would take (``--peak_tbs``) and its time against torch SDPA and our Triton dense decode of
this run.
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import types

from absl import app, flags
import jax
import jax.numpy as jnp

from configs import latency as latency_config
from experiments import profile_step
from experiments.common import results
from experiments.latency_lib import per_layer, settings, timing
import pallas_kernels
from pallas_kernels import _common
from pallas_kernels.block_select import BITS_PER_PASS, PHASES, block_select_phases
from sparse_attn import kernels

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("contexts", "32768,131072", "Tokens in the cache.")
  flags.DEFINE_string("dtype", "bfloat16", "Cache dtype.")
  flags.DEFINE_integer("steps", 32, "Decode steps per timed call, looped on the device.")
  flags.DEFINE_integer("repeats", 5, "Timed calls per configuration (median).")
  flags.DEFINE_string("splits", "0,2", "num_splits as multiples of the default (0 = default; "
                      "fractions allowed, e.g. 0.5).")
  flags.DEFINE_bool("dense_grid", True, "Time the dense decode's grid (--nodense_grid: only "
                    "the other sweeps).")
  flags.DEFINE_string("iters", "0/3,4/2,4/4,8/2,8/3", "blocks_per_iter/num_stages pairs "
                      "(0 = the default for the stages).")
  flags.DEFINE_string("warps", "4,8", "num_warps values.")
  flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU; a rehearsal, no timing "
                    "meaning).")
  flags.DEFINE_string("out", "", "JSON-lines file for the rows (appended).")
  flags.DEFINE_string("select_entries", "", "Block-select sweep: entries per row (Quest's "
                      "blocks, e.g. 8192 = 128k tokens of 16), empty = none.")
  flags.DEFINE_string("select_rows", "8,32", "Block-select sweep: rows (selection heads).")
  flags.DEFINE_float("select_keep", 0.1, "Block-select sweep: fraction of the entries chosen.")
  flags.DEFINE_string("select_bits", "1,2,4", "Block-select sweep: bits_per_pass values.")
  flags.DEFINE_string("select_warps", "0", "Block-select sweep: num_warps values (0 = the "
                      "default for the row length).")
  flags.DEFINE_string("mosaic", "", "Mosaic decode sweep: step bodies (mma, rows), empty = "
                      "none.")
  flags.DEFINE_string("mosaic_tokens", "64,128", "Mosaic decode sweep: tokens a step.")
  flags.DEFINE_string("mosaic_stages", "2,3,4", "Mosaic decode sweep: TMA ring depths.")
  flags.DEFINE_float("mosaic_keep", 0.1, "Mosaic decode sweep: the sparse list's fraction of "
                     "the blocks (0 = dense only).")
  flags.DEFINE_float("peak_tbs", 4.8, "Peak HBM bandwidth, TB/s (H200 4.8, H100 SXM 3.35), "
                     "for the fraction of peak.")
  flags.DEFINE_string("select_early", "0,1", "Block-select sweep: early_exit values (0/1; "
                      "with bits_per_pass 1 only).")
  flags.DEFINE_float("sparse_keep", 0.0, "Also sweep the Triton sparse_decode over a fixed "
                     "group list of this fraction of the blocks (0 = dense only).")
  flags.DEFINE_string("select_phases", "all", "Block-select sweep: kernel parts timed "
                      "(pallas_kernels.block_select.PHASES: io, threshold, place, all), each "
                      "with the default bits, warps and no early exit.")


def grid(n_blocks: int, programs: int) -> list[dict]:
  """The ``(num_splits, blocks_per_iter, num_stages, num_warps)`` rows of the flags."""
  base = _common.choose_num_splits(programs, n_blocks)
  rows = []
  mults = [float(x) for x in FLAGS.splits.split(",") if x.strip()]
  for mult, it, w in itertools.product(mults, FLAGS.iters.split(","), settings.ints(FLAGS.warps)):
    per_iter, stages = (int(x) for x in it.split("/"))
    rows.append(dict(num_splits=max(1, round(base * mult)) if mult else None,
                     blocks_per_iter=per_iter or None, num_stages=stages, num_warps=w))
  return rows


def kernel_step(b: per_layer.Bench, tiles: dict, steps: int, interpret: bool):
  """``steps`` dense decode steps (``kernels.dense_decode`` under ``tiles``) of the newest query
  over ``b``'s cache, one call."""
  positions = jnp.full((1,), b.context - 1, jnp.int32)

  @jax.jit
  def run(q, cache):
    def one(_, q):
      return kernels.dense_decode(q, cache, positions, impl="pallas", interpret=interpret,
                                  **tiles)[0]
    return jax.lax.fori_loop(0, steps, one, q)

  q = b.q[:, :, 0]
  return lambda: run(q, b.cache)


def mosaic_step(b: per_layer.Bench, idx, steps: int, interpret: bool, **kw):
  """``steps`` Mosaic GPU decode steps of the newest query over ``b``'s cache and the group
  lists ``idx [1, K, n]`` (all entries valid; None: ``dense_decode``, the identity mode), one
  call."""
  from pallas_kernels import mosaic  # pylint: disable=g-import-not-at-top (GPU JAX only)
  c = b.cache

  @jax.jit
  def run(q, c):
    def one(_, q):
      if idx is None:
        return mosaic.dense_decode(q, c.k, c.v, c.length, block_size=c.block_size, pos=c.pos,
                                   impl="mosaic", interpret=interpret, **kw)[0]
      n_valid = jnp.full(idx.shape[:2], idx.shape[-1], jnp.int32)
      return mosaic.sparse_decode(q, c.k, c.v, idx, n_valid, c.length, block_size=c.block_size,
                                  pos=c.pos, impl="mosaic", interpret=interpret, **kw)[0]
    return jax.lax.fori_loop(0, steps, one, q)

  q = b.q[:, :, 0]
  return lambda: run(q, c)


def sparse_step(b: per_layer.Bench, idx, tiles: dict, steps: int, interpret: bool):
  """``steps`` Triton sparse decode steps of the newest query over ``b``'s cache and the group
  lists ``idx [1, K, n]`` (all entries valid) under ``tiles``, one call."""
  c = b.cache
  n_valid = jnp.full(idx.shape[:2], idx.shape[-1], jnp.int32)

  @jax.jit
  def run(q, c):
    def one(_, q):
      return pallas_kernels.sparse_decode(q, c.k, c.v, idx, n_valid, c.length,
                                          block_size=c.block_size, pos=c.pos, impl="pallas",
                                          interpret=interpret, **tiles)[0]
    return jax.lax.fori_loop(0, steps, one, q)

  q = b.q[:, :, 0]
  return lambda: run(q, c)


def mosaic_lists(nb: int, kv_heads: int, keep: float) -> dict:
  """``{name: [1, K, n] int32 or None}``: the identity mode (``dense_decode``: no list), every
  block as a list (dense) and, with ``keep``, ``keep * nb`` fixed random blocks per kv head in
  id order."""
  out = {"identity": None, "dense": jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (1, kv_heads, nb))}
  if keep:
    n = max(1, int(keep * nb))
    keys = jax.random.split(jax.random.key(1), kv_heads)
    out[f"keep {keep}"] = jnp.stack([jnp.sort(jax.random.permutation(k, nb)[:n])
                                     for k in keys])[None].astype(jnp.int32)
  return out


def mosaic_sweep(out, b: per_layer.Bench, peers: dict, steps: int):
  """Times the Mosaic decode per list, step body, tokens a step and ring depth (the module
  docstring's ``--mosaic``)."""
  s = b.s
  nb = -(-b.context // s.block_size)
  itemsize = jnp.dtype(b.dtype).itemsize
  for name, idx in mosaic_lists(nb, s.num_kv_heads, FLAGS.mosaic_keep).items():
    entries = nb if idx is None else int(idx.shape[-1])
    moved = 2 * s.num_kv_heads * entries * s.block_size * s.head_dim * itemsize
    bound_us = moved / (FLAGS.peak_tbs * 1e12) * 1e6
    for body, tokens, stages in itertools.product(FLAGS.mosaic.split(","),
                                                  settings.ints(FLAGS.mosaic_tokens),
                                                  settings.ints(FLAGS.mosaic_stages)):
      if body not in ("mma", "rows"):
        raise ValueError(f"--mosaic bodies are mma and rows, got {body!r}")
      kw = dict(mma=body == "mma", tokens_per_step=tokens, num_stages=stages)
      got = _timed(lambda: mosaic_step(b, idx, steps, FLAGS.interpret, **kw), steps,
                   f"{b.context} mosaic {name} {kw}")
      if got is None:
        continue
      first, us, kernel, device = got
      row = dict(_provenance(), section="mosaic_decode", context=b.context, dtype=FLAGS.dtype,
                 list=name, entries=entries, body=body, tokens_per_step=tokens,
                 num_stages=stages, us_per_step=us, first_s=first, kernel_us=kernel,
                 device_us=device, bytes=moved, bound_us=bound_us,
                 peak_fraction=bound_us / us, peak_tbs=FLAGS.peak_tbs, peers_us=peers)
      ratios = ", ".join(f"x {k} {v / us:.2f}" for k, v in peers.items())
      print(f"{b.context} mosaic {name} {body} W={tokens} stages={stages}: {us:.1f} us/step "
            f"({100 * bound_us / us:.0f}% of peak), kernel {_us(kernel)}, {ratios}", flush=True)
      if out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def _timed(make, steps: int, label: str):
  """``(first call s, us per step, kernel us, device-op us)`` of the decode call ``make()``
  builds, or None (printed) for a launch that does not fit."""
  try:
    fn = make()
    first, us = median_step_us(fn, steps, FLAGS.repeats)
  except Exception as e:  # pylint: disable=broad-except (a launch that does not fit)
    print(f"{label}: failed ({type(e).__name__}: {str(e)[:160]})", flush=True)
    return None
  return (first, us) + device_us(fn, steps, "sparse_decode")


def sparse_sweep(out, b: per_layer.Bench, peers: dict, steps: int):
  """Times the Triton sparse decode over a ``--sparse_keep`` group list per launch
  configuration of the grid (the module docstring's ``--sparse_keep``)."""
  s = b.s
  nb = -(-b.context // s.block_size)
  idx = mosaic_lists(nb, s.num_kv_heads, FLAGS.sparse_keep)[f"keep {FLAGS.sparse_keep}"]
  n = int(idx.shape[-1])
  moved = 2 * s.num_kv_heads * n * s.block_size * s.head_dim * jnp.dtype(b.dtype).itemsize
  bound_us = moved / (FLAGS.peak_tbs * 1e12) * 1e6
  for tiles in grid(n, s.num_kv_heads):
    got = _timed(lambda: sparse_step(b, idx, tiles, steps, FLAGS.interpret), steps,
                 f"{b.context} sparse {tiles}")
    if got is None:
      continue
    first, us, kernel, device = got
    row = dict(_provenance(), section="sparse_decode", context=b.context, dtype=FLAGS.dtype,
               keep=FLAGS.sparse_keep, entries=n, us_per_step=us, first_s=first,
               kernel_us=kernel, device_us=device, bytes=moved, bound_us=bound_us,
               peak_fraction=bound_us / us, peak_tbs=FLAGS.peak_tbs, peers_us=peers, **tiles)
    print(f"{b.context} sparse keep {FLAGS.sparse_keep} {tiles}: {us:.1f} us/step "
          f"({100 * bound_us / us:.0f}% of peak), kernel {_us(kernel)}", flush=True)
    if out:
      out.write(json.dumps(row) + "\n")
      out.flush()


def _provenance() -> dict:
  return dict(git=results.git_revision(), machine=results.machine(),
              device=jax.devices()[0].device_kind, jax=jax.__version__, steps=FLAGS.steps,
              repeats=FLAGS.repeats)


def median_step_us(fn, steps: int, repeats: int) -> tuple[float, float]:
  """(first call s, median us per step over ``repeats`` calls) of a ``steps``-step call."""
  first = timing.call(fn)
  timing.call(fn)
  times = [timing.call(fn) for _ in range(repeats)]
  return first, statistics.median(times) / steps * 1e6


def device_us(fn, steps: int, kernel: str) -> tuple[float | None, float | None]:
  """``(kernel us, all ops us)`` per step of ``fn`` from a profiler trace of two calls: the
  device time of the ops named ``kernel`` (None when no op has that name) and of every op.

  A step's wall time (``median_step_us``) also holds the loop's own cost. On an H100 the
  select's wall time stayed at 22-30 us from 2048 to 8192 entries and from 1 to 4 bits a pass
  (results/gpu_decode/decode_sweep.jsonl), while the H200 profile put the kernel alone at 31 us
  at 8192 entries (results/gpu_h200/lease/PROFILE.md): the trace says which part a variant
  changes. ``(None, None)`` off a GPU (a CPU trace of this loop may have no op lines)."""
  if jax.default_backend() != "gpu":
    return None, None
  ops = profile_step.profile(types.SimpleNamespace(fn=fn), 2, steps)
  mine = [us for name, (us, _) in ops.items() if kernel in name]
  return (sum(mine) if mine else None), sum(us for us, _ in ops.values())


def _us(x) -> str:
  return "-" if x is None else f"{x:.1f} us"


def select_step(rows: int, entries: int, keep: float, steps: int, interpret: bool,
                phases: str = "all", **kw):
  """``steps`` selections of ``keep * entries`` of ``[rows, entries]`` random scores, one call
  (each step's scores shifted by the previous list's first id, so no step is loop-invariant);
  ``phases`` other than ``"all"``: the kernel with parts left out
  (``block_select.block_select_phases``)."""
  select = pallas_kernels.block_select
  if phases != "all":
    select = functools.partial(block_select_phases, phases=phases)
    kw.pop("impl")
  scores = jax.random.normal(jax.random.key(0), (rows, entries), jnp.float32)
  count = jnp.full((rows,), max(1, int(keep * entries)), jnp.int32)
  n = int(count[0])

  @jax.jit
  def run(scores):
    def one(_, carry):
      ids = select(carry, count, n=n, interpret=interpret, **kw)
      return carry + ids[:, :1].astype(jnp.float32) * 1e-30
    return jax.lax.fori_loop(0, steps, one, scores)
  return lambda: run(scores)


def select_sweep(out, steps: int):
  """Times the select kernel per ``bits_per_pass``, ``num_warps`` and ``early_exit``, and
  ``lax.top_k`` (``impl="xla"``); with ``--select_phases``, the kernel's parts (what of the
  H200's 31 us at 8192 entries is the launch and memory floor, the counting passes, the
  placement)."""
  for entries, rows in itertools.product(settings.ints(FLAGS.select_entries),
                                         settings.ints(FLAGS.select_rows)):
    phases = FLAGS.select_phases.split(",")
    bad = sorted(set(phases) - set(PHASES))
    if bad:
      raise ValueError(f"--select_phases takes {PHASES}, got {bad}")
    runs = []
    if "all" in phases:  # the whole kernel per setting, next to lax.top_k
      runs = [("xla", 1, 0, 0, "all")] + [
          ("pallas", b, w, e, "all") for b, w, e in itertools.product(
              settings.ints(FLAGS.select_bits), settings.ints(FLAGS.select_warps),
              settings.ints(FLAGS.select_early)) if b == 1 or not e]
    runs += [("pallas", BITS_PER_PASS, 0, 0, ph) for ph in phases if ph != "all"]
    for impl, bits, warps, early, phase in runs:
      fn = select_step(rows, entries, FLAGS.select_keep, steps, FLAGS.interpret and impl ==
                       "pallas", phases=phase, impl=impl, bits_per_pass=bits,
                       num_warps=warps or None, early_exit=bool(early))
      first, us = median_step_us(fn, steps, FLAGS.repeats)
      kernel, device = device_us(fn, steps, "block_select")
      row = dict(_provenance(), section="block_select", entries=entries, rows=rows,
                 keep=FLAGS.select_keep, impl=impl, bits_per_pass=bits, num_warps=warps or None,
                 early_exit=bool(early), phases=phase, us_per_step=us, first_s=first,
                 kernel_us=kernel, device_us=device)
      print(f"select {rows}x{entries} {impl} bits={bits} warps={warps or 'default'} "
            f"early_exit={bool(early)} phases={phase}: {us:.1f} us/step, kernel {_us(kernel)}, "
            f"device ops "
            f"{_us(device)}", flush=True)
      if out:
        out.write(json.dumps(row) + "\n")
        out.flush()


def main(argv):
  del argv
  c = latency_config.get_config()
  c.update(dict(impl="pallas", steps_per_call=FLAGS.steps))
  s = settings.resolve(c)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {FLAGS.dtype}, "
        f"{FLAGS.steps} steps per call", flush=True)
  out = open(FLAGS.out, "a") if FLAGS.out else None
  if FLAGS.select_entries:
    select_sweep(out, FLAGS.steps)
  for ctx in settings.ints(FLAGS.contexts):
    b = per_layer.Bench(s, FLAGS.dtype, ctx, 8, s.seed, ("box",))
    peers = {}
    for name, cand in (("torch SDPA", lambda: b.torch_sdpa(1)), ("jax SDPA", b.jax_sdpa)):
      try:
        cd = cand()
        peers[name if name == "torch SDPA" else cd.name] = median_step_us(
            cd.fn, cd.per_call, FLAGS.repeats)[1]
      except Exception as e:  # pylint: disable=broad-except (a peer missing on this machine)
        print(f"{ctx} {name}: unavailable ({type(e).__name__}: {str(e)[:120]})", flush=True)
    b.kv_numpy = None
    sdpa = peers.get("torch SDPA", float("nan"))
    print(f"\n== context {ctx}: " + ", ".join(f"{k} {v:.1f} us" for k, v in peers.items()),
          flush=True)
    nb = -(-ctx // s.block_size)
    if FLAGS.mosaic:
      triton = {} if FLAGS.interpret else {"triton dense": median_step_us(
          kernel_step(b, {}, FLAGS.steps, False), FLAGS.steps, FLAGS.repeats)[1]}
      mosaic_sweep(out, b, {**peers, **triton}, FLAGS.steps)
    if FLAGS.sparse_keep and FLAGS.iters:
      sparse_sweep(out, b, peers, FLAGS.steps)
    for tiles in grid(nb, s.num_kv_heads) if FLAGS.iters and FLAGS.dense_grid else ():
      try:
        first, us = median_step_us(kernel_step(b, tiles, FLAGS.steps, FLAGS.interpret),
                                   FLAGS.steps, FLAGS.repeats)
      except Exception as e:  # pylint: disable=broad-except (a launch that does not fit)
        print(f"{ctx} {tiles}: failed ({type(e).__name__}: {str(e)[:160]})", flush=True)
        continue
      row = dict(_provenance(), section="dense_decode", context=ctx, dtype=FLAGS.dtype,
                 us_per_step=us, first_s=first, x_sdpa=sdpa / us, peers_us=peers, **tiles)
      print(f"{ctx} {tiles}: {us:.1f} us/step, x sdpa {sdpa / us:.2f}", flush=True)
      if out:
        out.write(json.dumps(row) + "\n")
        out.flush()
  if out:
    out.close()


if __name__ == "__main__":
  define_flags()
  app.run(main)
