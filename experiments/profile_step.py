r"""Device-op profile of one decode step per method: which ops a step runs and what each costs.

  python -m experiments.profile_step --context=32768 \
      --methods=dense,quest:gqa=group,quest:gqa=group+resa --impl=pallas --steps=32

One Llama-3.1-8B-shaped attention layer (``configs/latency.py``'s shape), the same jitted,
donated step as ``experiments.latency``'s per-layer section (``steps`` decode steps looped on the
device per call). ``jax.profiler`` traces ``calls`` calls per method; the trace's per-op device
times (each device plane's ``XLA Ops`` or kernel-stream events; on a CPU the XLA thread lines) are summed and
divided by the steps, so the table reads "microseconds per decode step" per op. Prints the
``top`` ops of each method and the difference of every method's op list to the first method's.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile

from absl import app, flags
import jax

from configs import latency as latency_config
from experiments.latency_lib import per_layer, settings

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so the module imports cleanly)."""
  flags.DEFINE_integer("context", 32768, "Tokens in the cache.")
  flags.DEFINE_string("dtype", "bfloat16", "Cache dtype.")
  flags.DEFINE_string("methods", "quest:gqa=group,quest:gqa=group+resa", "Method specs.")
  flags.DEFINE_string("impl", "auto", "auto | xla | pallas.")
  flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU).")
  flags.DEFINE_integer("steps", 32, "Decode steps per call, looped on the device.")
  flags.DEFINE_integer("calls", 3, "Traced calls per method.")
  flags.DEFINE_integer("prefill_chunk", 0, "Profile the last prefill chunk of this many tokens "
                       "+ end_prefill (one call = one chunk) instead of decode steps.")
  flags.DEFINE_integer("top", 12, "Ops shown per method.")
  flags.DEFINE_integer("num_heads", 32, "Query heads.")
  flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
  flags.DEFINE_integer("head_dim", 128, "Head dim.")


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


def main(argv):
  del argv
  c = latency_config.get_config()
  c.update(dict(impl=FLAGS.impl, interpret=FLAGS.interpret, steps_per_call=FLAGS.steps,
                num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
                head_dim=FLAGS.head_dim))
  s = settings.resolve(c)
  specs = settings.split_list(FLAGS.methods)
  ms = [(spec, per_layer.make_method(spec, s)) for spec in specs]
  max_new = max([8] + [m.window for _, m in ms])
  b = per_layer.Bench(s, FLAGS.dtype, FLAGS.context, max_new, s.seed)
  b.kv_numpy = None
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {FLAGS.dtype}, "
        f"context {FLAGS.context}, {FLAGS.steps} steps per call", flush=True)
  profiles = {}
  for spec, m in ms:
    cand = b.last_chunk(m, spec, FLAGS.prefill_chunk, 1) if FLAGS.prefill_chunk else (
        b.candidates(m, spec)[0])
    for _ in range(2):  # compile and warm
      jax.block_until_ready(cand.fn())
    prof = profile(cand, FLAGS.calls, 1 if FLAGS.prefill_chunk else FLAGS.steps)
    profiles[spec] = prof
    total = sum(us for us, _ in prof.values())
    launches = sum(c for _, c in prof.values())
    print(f"\n== {spec}: {total:.1f} us of device ops per step, {launches:.1f} ops per step")
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
