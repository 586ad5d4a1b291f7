r"""End to end on a named Hugging Face shape with random weights: ours vs ``transformers``.

The ``shape_e2e`` section of ``experiments.latency``. For every context x batch of the config it
times, for each method spec (``shape_methods``; paper presets as they stand), greedy decode in
ms per step and the chunked prefill of the prompt (``shape_ours``), and the same for
``transformers``' ``LlamaForCausalLM`` with SDPA on the same device (``shape_peer``). Every
decode row carries the bytes a step reads (weights + the KV its method reads,
``shapes.weight_bytes`` / ``shapes.kv_bytes``) and its fraction of the bandwidth bound at the
device's peak (``peak_bandwidth_gbs``, else the data-sheet figure of the device's name).

Each engine runs in a child process (``python -m experiments.latency_lib.shape_e2e``, job on
stdin, one line per event on stdout) that builds the model once and runs the parts one after
the other: the child's GPU memory is its own (``transformers`` and JAX never share a
process), and every part has its own timeout (``shape_part_timeout_s``, counted from the
part's start; model building counts against the first). A part that times out or crashes its
child is recorded as such and the child is restarted for the rest; a part whose caches do not
fit is recorded as skipped with the bytes it needed. Nothing is dropped silently: every part
of the grid gets a record. Failures (timeouts, errors) are written without a key, so a rerun
in the same workdir retries them; finished and skipped parts are kept.

On a GPU the parent must not hold the device's memory: run with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (``configs/latency_gpu.py`` says how), and the runner
runs this section before any other touches the device.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

from experiments.latency_lib import settings

SECTION = "shape_e2e"
_MARK = "@@shape_e2e "
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grid(s) -> dict[str, list[dict]]:
  """``engine -> parts``: contexts outermost (short ones finish first), then batches, then
  each method's prefill (``shape_prefill_methods`` at ``shape_prefill_batches``) and decode."""
  methods = settings.split_list(s.shape_methods)
  pre_methods = settings.split_list(s.shape_prefill_methods)
  pre_batches = settings.ints(s.shape_prefill_batches)
  out: dict[str, list[dict]] = {"ours": [], "transformers": []}
  for ctx in settings.ints(s.shape_contexts):
    for b in settings.ints(s.shape_batches):
      common = dict(section=SECTION, shape=s.shape, dtype=s.shape_dtype, batch=b, context=ctx)
      for engine, names in (("ours", methods), ("transformers", ["transformers"])):
        if engine == "transformers" and not s.shape_transformers:
          continue
        pre = pre_methods if engine == "ours" else names
        for phase, specs in (("prefill", pre if b in pre_batches else []), ("decode", names)):
          for spec in specs:
            part = dict(common, phase=phase, method=spec)
            part["part"] = key(part, s)
            out[engine].append(part)
  return out


def key(part: dict, s) -> str:
  """The record key of a part (the prefill chunk is part of ours: it changes the time)."""
  k = (f"{SECTION}/{part['shape']}/{part['dtype']}/{part['phase']}/b{part['batch']}/"
       f"{part['context']}/{part['method']}")
  if part["phase"] == "prefill" and part["method"] != "transformers":
    k += f"/chunk={s.shape_prefill_chunk}"
  return k


def run(s, done, write_record, workdir: str) -> None:
  """Runs every part of ``grid(s)`` not yet ``done``; one record per part (see module doc)."""
  _check_memory_not_held()
  from experiments.latency_lib import shape_ours, shapes  # pylint: disable=g-import-not-at-top
  shapes.model_config(s.shape, s.shape_dtype)  # a bad name or spec fails here, not in a child
  for spec in settings.split_list(s.shape_methods) + settings.split_list(s.shape_prefill_methods):
    shape_ours.make_method(spec, s)
  log = os.path.join(workdir, "shape_e2e.log")
  for engine, parts in grid(s).items():
    todo = [p for p in parts if not done(p["part"])]
    if todo:
      _run_engine(engine, s, todo, log, write_record)


def _check_memory_not_held() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() == "gpu" and os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false":
    raise ValueError("the shape_e2e section runs its models in child processes, and this one "
                     "holds most of the GPU's memory: run with XLA_PYTHON_CLIENT_PREALLOCATE=false")


def _write(write_record, rec: dict) -> None:
  ok = rec.get("status") in ("ok", "skipped")
  write_record(rec, rec["part"] if ok else None)  # failures unkeyed: a rerun retries them
  what = (f"{rec.get('step_ms', 0):.3g} ms/step" if "step_ms" in rec else
          f"{rec.get('seconds', 0):.3g} s" if "seconds" in rec else rec.get("reason", ""))
  frac = rec.get("bound_fraction")
  note = f" ({frac:.2f} of the bandwidth bound)" if frac else ""
  print(f"shape_e2e: {rec['engine']} {rec['phase']} b{rec['batch']} {rec['context']} "
        f"{rec['method']}: {rec['status']} {str(what)[:200]}{note}", file=sys.stderr, flush=True)


def _failure(part: dict, engine: str, status: str, reason: str) -> dict:
  return dict(part, engine=engine, status=status, reason=reason)


def _tail(path: str, start: int, n: int = 1500) -> str:
  try:
    with open(path, "rb") as f:
      f.seek(max(start, os.path.getsize(path) - n))
      return f.read().decode("utf-8", "replace")
  except OSError:
    return ""


def _run_engine(engine: str, s, parts: list[dict], log: str, write_record) -> None:
  """Runs ``parts`` in child processes until each has a record (restarting after a timeout or
  a crash, without the part that caused it)."""
  timeout = float(s.shape_part_timeout_s)
  # the run's deadline (epoch seconds, ``paper_runs``): no part starts or runs past it
  end = time.monotonic() + float(s.values.get("deadline") or "inf") - time.time()
  env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1")
  if engine != "transformers":
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the child owns the device
  else:
    env["JAX_PLATFORMS"] = "cpu"  # the torch child imports JAX (the byte model): keep it off
  remaining = list(parts)
  while remaining:
    if time.monotonic() >= end:
      print(f"shape_e2e: deadline reached, {len(remaining)} part(s) left for a later run",
            file=sys.stderr, flush=True)
      return
    job = json.dumps(dict(engine=engine, settings=s.values, parts=remaining))
    with open(log, "ab") as err:
      start = err.tell()
      proc = subprocess.Popen([sys.executable, "-m", "experiments.latency_lib.shape_e2e"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                              text=True, cwd=_ROOT, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    proc.stdin.write(job)
    proc.stdin.close()
    current, clock = None, time.monotonic()
    while True:
      try:
        line = lines.get(timeout=max(0.0, min(clock + timeout, end) - time.monotonic()))
      except queue.Empty:
        proc.kill()
        proc.wait()
        if time.monotonic() >= end and clock + timeout > end:  # the run's time, not the part's
          if current is not None:
            _write(write_record, _failure(current, engine, "timeout", "the run's deadline"))
          return
        if current is None:  # building the model took the whole allowance: nothing can run
          for p in remaining:
            _write(write_record, _failure(p, engine, "timeout",
                                          f"model setup exceeded {timeout:.0f} s"))
          return
        _write(write_record, _failure(current, engine, "timeout",
                                      f"exceeded shape_part_timeout_s = {timeout:.0f} s"))
        remaining = [p for p in remaining if p["part"] != current["part"]]
        break
      if line is None:  # the child exited
        code = proc.wait()
        if not remaining:
          return
        why = f"child exited with code {code}: {_tail(log, start)}"
        failed = [current] if current is not None else remaining
        for p in failed:
          _write(write_record, _failure(p, engine, "error", why))
        names = {p["part"] for p in failed}
        remaining = [p for p in remaining if p["part"] not in names]
        break
      if not line.startswith(_MARK):
        sys.stderr.write(line)
        continue
      event, payload = json.loads(line[len(_MARK):])
      if event == "start":
        current, clock = payload, time.monotonic()
      elif event == "record":
        _write(write_record, payload)
        remaining = [p for p in remaining if p["part"] != payload["part"]]
        current, clock = None, time.monotonic()


def _pump(stream, out: queue.Queue) -> None:
  for line in stream:
    out.put(line)
  out.put(None)


def _emit(event: str, payload: dict) -> None:
  text = json.dumps([event, payload], default=lambda x: x.item() if hasattr(x, "item") else str(x))
  print(_MARK + text, flush=True)


def main() -> None:
  """Child: reads ``{engine, settings, parts}`` from stdin, emits events on stdout."""
  job = json.load(sys.stdin)
  s = settings.Settings(job["settings"])
  module = {"ours": "shape_ours", "transformers": "shape_peer", "kernels": "breakdown"}
  engine = importlib.import_module(f"experiments.latency_lib.{module[job['engine']]}")
  from experiments.common import provenance  # pylint: disable=g-import-not-at-top

  def emit(event: str, payload: dict) -> None:  # a record says what this child imported
    _emit(event, dict(payload, **provenance.child_fields()) if event == "record" else payload)
  engine.run_parts(s, job["parts"], emit)


if __name__ == "__main__":
  main()
