"""tests.isolated: the reference child is one process per worker, replaced after a death; ``run``
starts a fresh one per call."""

import os

import pytest

from tests import isolated


def _pid():
  return os.getpid()


def _fail():
  raise ValueError("a reference that failed")


def _die():
  os._exit(3)  # pylint: disable=protected-access


def test_reference_reuses_its_child_and_replaces_a_dead_one():
  first = isolated.reference(_pid)
  assert first != os.getpid() and isolated.reference(_pid) == first
  with pytest.raises(RuntimeError, match="ValueError: a reference that failed"):
    isolated.reference(_fail)
  assert isolated.reference(_pid) == first  # an exception leaves the child serving
  with pytest.raises(RuntimeError, match="_die: the child process died"):
    isolated.reference(_die)
  assert isolated.reference(_pid) not in (first, os.getpid())


def test_run_starts_a_fresh_process_per_call():
  assert len({isolated.run(_pid), isolated.run(_pid), os.getpid()}) == 3
