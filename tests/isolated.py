"""Runs a function in another interpreter: PyTorch never enters a pytest worker.

The transformers/PyTorch references of the parity tests are data: ``reference`` and ``run``
compute them in a spawned child, so the long-lived JAX workers never load PyTorch (its
libraries, threads and memory stay out of them) and a child that dies or hangs fails its test,
with a clear message, instead of taking a worker (and the suite) down. Only plain data (numpy
arrays, lists, strings) comes back.

``run`` starts a fresh interpreter per call (for a function that measures its own process,
changes its environment or runs a whole experiment). ``reference`` reuses one child per pytest
worker, started at its first call and replaced after a death or a timeout: importing torch and
transformers costs ~6 CPU seconds a process, which the suite's dozen reference calls paid each.
"""

from __future__ import annotations

import multiprocessing
import traceback


def _call(conn, fn, args, kwargs):
  try:
    conn.send((True, fn(*args, **kwargs)))
  except BaseException:  # pylint: disable=broad-except (reported to the parent)
    conn.send((False, traceback.format_exc()))


def _once(conn, fn, args, kwargs):
  try:
    _call(conn, fn, args, kwargs)
  finally:
    conn.close()


def _serve(conn):
  """The reference child's loop: one ``(fn, args, kwargs)`` after another until the parent
  closes its end."""
  while True:
    try:
      fn, args, kwargs = conn.recv()
    except EOFError:
      return
    _call(conn, fn, args, kwargs)


def _result(proc, conn, fn, timeout: float):
  """The child's answer to one call; raises what the module docstring says."""
  if not conn.poll(timeout):
    raise TimeoutError(f"{fn.__name__} gave no result within {timeout:.0f} s")
  try:
    ok, value = conn.recv()
  except EOFError as e:
    proc.join(5)
    raise RuntimeError(f"{fn.__name__}: the child process died "
                       f"(exit code {proc.exitcode})") from e
  if not ok:
    raise RuntimeError(f"{fn.__name__} raised in the child process:\n{value}")
  return value


def run(fn, *args, timeout: float = 900.0, **kwargs):
  """``fn(*args, **kwargs)`` in a fresh spawned process (``fn`` a module-level function).

  Raises:
    RuntimeError: the child raised (its traceback is in the message) or died.
    TimeoutError: no result within ``timeout`` seconds (the child is killed).
  """
  ctx = multiprocessing.get_context("spawn")
  recv, send = ctx.Pipe(duplex=False)
  proc = ctx.Process(target=_once, args=(send, fn, args, kwargs), daemon=True)
  proc.start()
  send.close()
  try:
    return _result(proc, recv, fn, timeout)
  finally:
    proc.join(5)
    if proc.is_alive():
      proc.kill()


_reference_child = []  # [(process, connection)] of this worker's reference child, once started


def reference(fn, *args, timeout: float = 900.0, **kwargs):
  """``fn(*args, **kwargs)`` in this worker's reference child (``fn`` a module-level function
  that leaves the process as it found it: no environment changes, no measurements of it).

  Raises: as ``run``; a child that died or timed out is killed and the next call starts anew.
  """
  if not _reference_child or not _reference_child[0][0].is_alive():
    _reference_child.clear()
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child_conn,), daemon=True)
    proc.start()
    child_conn.close()
    _reference_child.append((proc, conn))
  proc, conn = _reference_child[0]
  try:
    conn.send((fn, args, kwargs))
    return _result(proc, conn, fn, timeout)
  except BrokenPipeError as e:  # it died after its last answer
    _reference_child.clear()
    raise RuntimeError(f"{fn.__name__}: the child process died") from e
  except TimeoutError:
    _reference_child.clear()
    proc.kill()
    raise
  except RuntimeError:  # an exception in fn (the child serves on) or its death
    if not proc.is_alive():
      _reference_child.clear()
    raise
