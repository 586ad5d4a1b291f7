r"""Device-op profile of one decode step per method: which ops a step runs and what each costs.

  python -m experiments.profile_step --context=32768 \
      --methods=dense,quest:gqa=group,quest:gqa=group+resa --impl=pallas --steps=32

One Llama-3.1-8B-shaped attention layer (``configs/latency.py``'s shape), the same jitted,
donated step as ``experiments.latency``'s per-layer section (``steps`` decode steps looped on the
device per call). ``jax.profiler`` traces ``calls`` calls per method; the trace's per-op device
times (each device plane's ``XLA Ops`` or kernel-stream events; on a CPU the XLA thread lines) are summed and
divided by the steps, so the table reads "microseconds per decode step" per op. Prints the
``top`` ops of each method and the difference of every method's op list to the first method's.

  python -m experiments.profile_step --shape=llama-3.1-8b --context=32768 \
      --methods=dense,quest:gqa=group,quest:gqa=group+resa --impl=pallas --steps=8

``--shape`` profiles whole-model decode steps instead: a random-weight model of that named
shape (``experiments.latency_lib.shapes``) over random caches at ``--context`` tokens, stepped
by ``models.driver.Decoder`` as the end-to-end benchmark (``configs/latency_gpu.py``,
``shape_e2e``) times it, so its per-op table explains that benchmark's ms per token.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time

from absl import app, flags
import jax

from configs import latency as latency_config
from experiments.latency_lib import per_layer, settings, shape_ours, shapes, timing

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so the module imports cleanly)."""
  flags.DEFINE_integer("context", 32768, "Tokens in the cache.")
  flags.DEFINE_string("dtype", "bfloat16", "Cache dtype.")
  flags.DEFINE_string("methods", "quest:gqa=group,quest:gqa=group+resa", "Method specs.")
  flags.DEFINE_string("impl", "auto", "auto | xla | pallas | mosaic.")
  flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU).")
  flags.DEFINE_integer("steps", 32, "Decode steps per call, looped on the device.")
  flags.DEFINE_integer("calls", 3, "Traced calls per method.")
  flags.DEFINE_integer("prefill_chunk", 0, "Profile the last prefill chunk of this many tokens "
                       "+ end_prefill (one call = one chunk) instead of decode steps.")
  flags.DEFINE_integer("top", 12, "Ops shown per method.")
  flags.DEFINE_integer("num_heads", 32, "Query heads.")
  flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
  flags.DEFINE_integer("head_dim", 128, "Head dim.")
  flags.DEFINE_string("shape", "", "Profile whole-model decode steps of a random model of this "
                      "named shape (e.g. llama-3.1-8b, tiny) instead of one attention layer.")
  flags.DEFINE_integer("batch", 1, "Batch of the whole-model decode (--shape).")


def _op_lines(data):
  """The trace lines whose events are ops: a device plane's ``XLA Ops`` line where the profiler
  writes one, else its ``Stream`` lines (one event per kernel); on a CPU the host's XLA thread
  lines (``tf_XLA...``)."""
  device = [p for p in data.planes if p.name.startswith("/device:")]
  if device:
    lines = [ln for p in device for ln in p.lines if ln.name == "XLA Ops"]
    return lines or [ln for p in device for ln in p.lines if ln.name.startswith("Stream")]
  return [ln for p in data.planes if p.name.startswith("/host:") for ln in p.lines
          if ln.name.startswith("tf_XLA")]


def op_times(trace_dir: str) -> dict[str, tuple[float, int]]:
  """op name -> (total ns, count) over the op lines of the trace under ``trace_dir``."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
  data = jax.profiler.ProfileData.from_file(paths[0])
  tot: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  lines = _op_lines(data)
  if not lines:
    names = {p.name: [ln.name for ln in p.lines] for p in data.planes}
    raise ValueError(f"no op lines in the trace; planes and lines: {names}")
  for line in lines:
    for ev in line.events:
      if ev.name.startswith("ThunkExecutor"):  # a CPU executable's own span, not an op
        continue
      tot[ev.name][0] += ev.duration_ns
      tot[ev.name][1] += 1
  return {k: (v[0], v[1]) for k, v in tot.items()}


def profile(cand, calls: int, steps: int) -> dict[str, tuple[float, float]]:
  """op -> (us per step, launches per step) of ``cand`` (already compiled)."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d)
    for _ in range(calls):
      jax.block_until_ready(cand.fn())
    jax.profiler.stop_trace()
    ops = op_times(d)
  n = calls * steps
  return {k: (ns / 1e3 / n, c / n) for k, (ns, c) in ops.items()}


def model_candidates(s, specs):
  """``(spec, Candidate)`` per method: ``steps`` whole-model decode steps per call (``--shape``),
  each method's caches dropped before the next method's are made."""
  config = shapes.model_config(FLAGS.shape, FLAGS.dtype)
  model = shapes.random_model(config, s.seed)
  total = 2 + (3 + FLAGS.calls) * FLAGS.steps  # the warm-up, timed and traced calls
  for spec in specs:
    m = shape_ours.make_method(spec, s)
    got = shape_ours.decoder(model, m, batch=FLAGS.batch, context=FLAGS.context, steps=total)
    if isinstance(got, str):
      raise ValueError(f"{spec}: {got}")
    loop, newest = got
    keys = list(jax.random.split(jax.random.key(2), total))
    done = [0]

    def fn(loop=loop, newest=newest, keys=keys, done=done):
      for _ in range(FLAGS.steps):
        nxt, _ = loop.step(newest + done[0], keys[done[0]])
        done[0] += 1
      return nxt, loop.caches, loop.states
    yield spec, timing.Candidate(spec, fn, per_call=FLAGS.steps)
    del loop


def layer_candidates(s, specs):
  """``(spec, Candidate)`` per method: one attention layer's decode steps (or prefill chunk)."""
  ms = [(spec, per_layer.make_method(spec, s)) for spec in specs]
  max_new = max([8] + [m.window for _, m in ms])
  b = per_layer.Bench(s, FLAGS.dtype, FLAGS.context, max_new, s.seed,
                      per_layer.cache_kinds([m for _, m in ms]))
  b.kv_numpy = None
  for spec, m in ms:
    yield spec, (b.last_chunk(m, spec, FLAGS.prefill_chunk, 1) if FLAGS.prefill_chunk else
                 b.candidates(m, spec)[0])


def main(argv):
  del argv
  c = latency_config.get_config()
  c.update(dict(impl=FLAGS.impl, interpret=FLAGS.interpret, steps_per_call=FLAGS.steps,
                num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
                head_dim=FLAGS.head_dim))
  s = settings.resolve(c)
  specs = settings.split_list(FLAGS.methods)
  what = (f"{FLAGS.shape} (random weights), batch {FLAGS.batch}, whole-model steps"
          if FLAGS.shape else "one attention layer")
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {FLAGS.dtype}, "
        f"context {FLAGS.context}, {what}, {FLAGS.steps} steps per call", flush=True)
  profiles = {}
  cands = model_candidates(s, specs) if FLAGS.shape else layer_candidates(s, specs)
  for spec, cand in cands:
    for _ in range(2):  # compile and warm
      jax.block_until_ready(cand.fn())
    per_call = 1 if FLAGS.prefill_chunk else FLAGS.steps
    t0 = time.perf_counter()  # one untraced call: the wall time the device ops sum up against
    jax.block_until_ready(cand.fn())
    wall_us = (time.perf_counter() - t0) / per_call * 1e6
    prof = profile(cand, FLAGS.calls, per_call)
    profiles[spec] = prof
    total = sum(us for us, _ in prof.values())
    launches = sum(c for _, c in prof.values())
    print(f"\n== {spec}: {total:.1f} us of device ops per step, {launches:.1f} ops per step; "
          f"{wall_us:.1f} us per step untraced, wall clock ({wall_us - total:+.1f} us not in ops)")
    for name, (us, cnt) in sorted(prof.items(), key=lambda kv: -kv[1][0])[:FLAGS.top]:
      print(f"  {us:9.2f} us  x{cnt:4.1f}  {name}")
  base_spec = specs[0]
  base = profiles[base_spec]
  for spec in specs[1:]:
    prof = profiles[spec]
    extra = {k: prof[k][0] - base.get(k, (0.0, 0))[0] for k in prof}
    extra.update({k: -us for k, (us, _) in base.items() if k not in prof})
    print(f"\n== {spec} minus {base_spec}: "
          f"{sum(extra.values()):+.1f} us per step; largest differences:")
    for name, us in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:FLAGS.top]:
      print(f"  {us:+9.2f} us  {name}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
