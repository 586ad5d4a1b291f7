"""Runs the selected sections, appending one JSON record per measurement (resumable)."""

from __future__ import annotations

import jax

from experiments.common import cli, results
from experiments.latency_lib import (end_to_end, memory, paper_runs, per_layer, prefill,
                                     prefill_chunk, report, resa_overhead, settings, shape_e2e)

# Sweep axes: every record's key names its section, dtype, context and method (a shape_e2e key
# also its shape and prefill chunk).
KEYED = ("sections", "contexts", "dtypes", "methods", "e2e_methods", "prefill_contexts",
         "decode_contexts", "memory_methods", "resa_contexts", "shape", "shape_dtype",
         "shape_batches", "shape_contexts", "shape_methods", "shape_prefill_methods",
         "shape_prefill_batches", "shape_prefill_chunk", "shape_transformers", "plan",
         "retro_windows", "batch_methods")
# Per-step medians whatever the loop length; limits that only decide what runs.
IGNORED = ("max_seconds_per_context", "steps_per_call", "shape_decode_steps", "shape_repeats",
           "shape_part_timeout_s", "paper_deadline_s")


def run(config, workdir: str) -> str:
  """Measures, writes ``results.jsonl``, ``latency.md``, ``latency.png``; returns the markdown."""
  s = settings.resolve(config)
  writer = results.ResultWriter(workdir, s.values, "latency", keyed=KEYED, ignore=IGNORED)
  sections = s.sections
  write = lambda rec, key: writer.write(rec, key=key)
  if paper_runs.SECTION in sections:  # first: its child processes need the device's memory
    paper_runs.run(s, writer.done, write, workdir)
  if "shape_e2e" in sections:  # first: its child processes need the device's memory
    shape_e2e.run(s, writer.done, write, workdir)
  if "per_layer" in sections or "torch_peer" in sections:
    specs = settings.split_list(s.methods) if "per_layer" in sections else ["dense"]
    grid = [(dt, ctx) for dt in settings.split_list(s.dtypes) for ctx in settings.ints(s.contexts)]
    prog = cli.Progress(len(grid), "per-layer", every=0.0)
    for dt, ctx in grid:
      key = lambda name: f"per_layer/{dt}/{ctx}/{name}"
      names = specs + (["torch SDPA (dense)"] if "torch_peer" in sections else [])
      if not all(writer.done(key(n)) for n in names):
        for rec in per_layer.run_context(s, dt, ctx, specs, "torch_peer" in sections):
          write(rec, key(rec["method"]))
        jax.clear_caches()
      prog.update(note=f"{dt} {ctx}")
  if "prefill_chunk" in sections:
    for dt in settings.split_list(s.dtypes):
      for ctx in settings.ints(s.contexts):
        key = lambda rec: f"prefill_chunk/{dt}/{ctx}/{rec['where']}/{rec['method']}"
        if not writer.done(f"prefill_chunk/{dt}/{ctx}/first/{prefill_chunk.KERNEL}"):
          for rec in prefill_chunk.run_context(s, dt, ctx, min(int(s.shape_prefill_chunk), ctx)):
            write(rec, key(rec))
  if "end_to_end" in sections:
    end_to_end.run(s, settings.split_list(s.e2e_methods), writer.done, write)
  if "memory" in sections:
    key = lambda spec: f"memory/{s.memory_context}/{spec}"
    todo = [m for m in settings.split_list(s.memory_methods) if not writer.done(key(m))]
    for rec in memory.measure(s, todo) if todo else []:
      write(dict(section="memory", **rec), key(rec["method"]))
  if "resa" in sections:
    for ctx in settings.ints(s.resa_contexts):
      key = lambda i: f"resa/{ctx}/{i}"
      if not writer.done(key(0)):
        for i, rec in enumerate(resa_overhead.run_context(s, ctx)):
          write(rec, key(i))
  if "prefill" in sections:
    prefill.run(s, writer.done, write)
  text, _ = report.write(writer.records(), workdir)
  return text
