"""Runs a function in a fresh interpreter: PyTorch never enters a pytest worker.

The transformers/PyTorch references of the parity tests are data: ``run`` computes them in a
spawned child, so the long-lived JAX workers never load PyTorch (its libraries, threads and
memory stay out of them) and a child that dies or hangs fails its test, with a clear message,
instead of taking a worker (and the suite) down. Only plain data (numpy arrays, lists,
strings) comes back.
"""

from __future__ import annotations

import multiprocessing
import traceback


def _call(conn, fn, args, kwargs):
  try:
    conn.send((True, fn(*args, **kwargs)))
  except BaseException:  # pylint: disable=broad-except (reported to the parent)
    conn.send((False, traceback.format_exc()))
  finally:
    conn.close()


def run(fn, *args, timeout: float = 900.0, **kwargs):
  """``fn(*args, **kwargs)`` in a spawned process (``fn`` a module-level function).

  Raises:
    RuntimeError: the child raised (its traceback is in the message) or died.
    TimeoutError: no result within ``timeout`` seconds (the child is killed).
  """
  ctx = multiprocessing.get_context("spawn")
  recv, send = ctx.Pipe(duplex=False)
  proc = ctx.Process(target=_call, args=(send, fn, args, kwargs), daemon=True)
  proc.start()
  send.close()
  try:
    if not recv.poll(timeout):
      raise TimeoutError(f"{fn.__name__} gave no result within {timeout:.0f} s")
    try:
      ok, value = recv.recv()
    except EOFError as e:
      raise RuntimeError(f"{fn.__name__}: the child process died "
                         f"(exit code {proc.exitcode})") from e
  finally:
    proc.join(5)
    if proc.is_alive():
      proc.kill()
  if not ok:
    raise RuntimeError(f"{fn.__name__} raised in the child process:\n{value}")
  return value
